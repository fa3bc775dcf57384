"""Mixed precision: the named policies and their casts, the ZeRO state-bytes formula, the fp32 master-weights and
dynamic loss-scaling optax combinators (exactness against fp32 references, skipped steps, growth, jit, sharding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from openhosti_jax.errors import PlanningError, StateError
from openhosti_jax.policies.optimizers import (
    LossScaleState,
    MasterWeightsState,
    dynamic_loss_scale,
    find_loss_scale,
    optimizer_for,
    scale_loss,
    with_master_weights,
)
from openhosti_jax.policies.precision import PRECISIONS, Precision, precision, state_bytes_per_param

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def _params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (16, 8), dtype),
        "b": jax.random.normal(k2, (8,), dtype) * 0.1,
    }


def _loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def _x(step):
    return jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (4, 16), jnp.float32)


def _bits(tree):
    return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


# ---- policies ----------------------------------------------------------------------------------------------------


def test_named_policies():
    assert set(PRECISIONS) == {"fp32", "bf16", "bf16_params", "fp16", "fp8"}
    fp32, bf16, bf16p, fp16 = (PRECISIONS[n] for n in ("fp32", "bf16", "bf16_params", "fp16"))
    assert (fp32.param_dtype, fp32.compute_dtype, fp32.output_dtype) == (F32, F32, F32)
    assert (bf16.param_dtype, bf16.compute_dtype, bf16.output_dtype) == (F32, BF16, F32)
    assert (bf16p.param_dtype, bf16p.compute_dtype, bf16p.output_dtype) == (BF16, BF16, F32)
    assert (fp16.param_dtype, fp16.compute_dtype, fp16.output_dtype) == (F32, F16, F32)
    assert [p.master_weights for p in (fp32, bf16, bf16p, fp16)] == [False, False, True, False]
    assert [p.loss_scaling for p in (fp32, bf16, bf16p, fp16)] == [False, False, False, True]
    fp8 = PRECISIONS["fp8"]  # bf16 with the blocks' matmuls in fp8 (tests/test_fp8.py)
    assert (fp8.param_dtype, fp8.compute_dtype, fp8.output_dtype, fp8.fp8_matmuls) == (F32, BF16, F32, True)
    for name, p in PRECISIONS.items():
        assert p.name == name and precision(name) is p and precision(p) is p
        assert all(isinstance(d, np.dtype) for d in (p.param_dtype, p.compute_dtype, p.output_dtype))
    hash(fp32)  # frozen, usable as a static jit argument
    with pytest.raises(AttributeError):
        fp32.name = "x"


def test_bad_policy_names_and_values():
    with pytest.raises(PlanningError, match="bf16_params"):
        precision("bf8")
    with pytest.raises(PlanningError):
        precision(3)
    with pytest.raises(PlanningError):
        Precision("x", jnp.int32, jnp.float32, jnp.float32)
    with pytest.raises(PlanningError):
        Precision("x", jnp.float32, jnp.float32, jnp.float32, master_weights=1)
    assert Precision("x", "float32", jnp.bfloat16, "float16").compute_dtype == BF16


def test_casts_touch_only_floating_leaves():
    p = PRECISIONS["bf16_params"]
    tree = {
        "jax": jnp.ones((2,), jnp.float32),
        "np": np.ones((3,), np.float32),
        "half": jnp.ones((2,), jnp.float16),
        "int": jnp.arange(3, dtype=jnp.int32),
        "npint": np.arange(3),
        "bool": jnp.array([True]),
        "abstract": jax.ShapeDtypeStruct((4, 5), jnp.float32),
        "abstract_int": jax.ShapeDtypeStruct((4,), jnp.int32),
        "scalar": 2,
        "none": None,
    }
    out = p.cast_to_compute(tree)
    assert out["jax"].dtype == BF16 and isinstance(out["jax"], jax.Array)
    assert out["np"].dtype == BF16 and isinstance(out["np"], np.ndarray)
    assert out["half"].dtype == BF16
    assert out["int"] is tree["int"] and out["npint"] is tree["npint"] and out["bool"] is tree["bool"]
    assert isinstance(out["abstract"], jax.ShapeDtypeStruct)
    assert out["abstract"].shape == (4, 5) and out["abstract"].dtype == BF16
    assert out["abstract_int"].dtype == np.int32
    assert out["scalar"] == 2 and out["none"] is None
    assert p.cast_output(out)["jax"].dtype == F32
    assert p.cast_to_param(tree)["np"].dtype == BF16
    assert PRECISIONS["fp16"].cast_to_compute(tree)["abstract"].dtype == F16
    # inside jit too
    assert jax.jit(p.cast_to_compute)(tree["jax"]).dtype == BF16
    # abstract trees keep their sharding
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sds = jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("d")))
    assert p.cast_to_param(sds).sharding == sds.sharding


# ---- state bytes -------------------------------------------------------------------------------------------------


def test_state_bytes_formula():
    bf16p, fp32 = PRECISIONS["bf16_params"], PRECISIONS["fp32"]
    assert state_bytes_per_param(bf16p, 0, 1) == 14.0
    assert state_bytes_per_param(fp32, 0, 1) == 12.0
    assert state_bytes_per_param(bf16p, 0, 8) == 14.0
    assert state_bytes_per_param(bf16p, 1, 4) == 2 + 12 / 4
    assert state_bytes_per_param(bf16p, 2, 4) == 2 + 12 / 4
    assert state_bytes_per_param(bf16p, 3, 4) == 14 / 4
    assert state_bytes_per_param(fp32, 0, 1, moments=1) == 8.0
    for bad in [(bf16p, 4, 1), (bf16p, 0, 0), (bf16p, 0, 1, -1), ("fp32", 0, 1), (bf16p, True, 1)]:
        with pytest.raises(PlanningError):
            state_bytes_per_param(*bad)


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_state_bytes_match_eval_shape(name):
    p = PRECISIONS[name]
    params = p.cast_to_param(jax.eval_shape(_params))
    tx = optimizer_for(optax.adam(1e-3), p)
    opt = jax.eval_shape(tx.init, params)
    n = sum(x.size for x in jax.tree.leaves(params))
    actual = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, opt)))
    assert actual / n == pytest.approx(state_bytes_per_param(p, 0, 1), rel=0.01)


# ---- master weights ----------------------------------------------------------------------------------------------


def test_master_weights_match_fp32_adam_exactly():
    ref = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), _params())  # bf16-representable
    low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), ref)
    ref_tx, tx = optax.adam(1e-2), with_master_weights(optax.adam(1e-2))
    ref_state, state = ref_tx.init(ref), tx.init(low)
    assert isinstance(state, MasterWeightsState)
    assert all(x.dtype == F32 for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))
    for step in range(5):
        grads = jax.grad(_loss)(ref, _x(step))  # the same fp32 grads for both
        ref_updates, ref_state = ref_tx.update(grads, ref_state, ref)
        ref = optax.apply_updates(ref, ref_updates)
        updates, state = tx.update(grads, state, low)
        assert all(u.dtype == F32 for u in jax.tree.leaves(updates))
        low = optax.apply_updates(low, updates)
        assert all(x.dtype == BF16 for x in jax.tree.leaves(low))
        assert _bits(state.master) == _bits(ref)
        assert _bits(state.inner) == _bits(ref_state)
        assert _bits(low) == _bits(jax.tree.map(lambda x: x.astype(jnp.bfloat16), ref))
    changed = jax.tree.map(
        lambda a, b: bool(jnp.any(a != b)), low, jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    )
    assert all(jax.tree.leaves(changed))


def test_master_weights_low_dtype_grads_and_jit():
    low = _params(jnp.bfloat16)
    tx = with_master_weights(optax.adam(1e-2))
    state = tx.init(low)

    @jax.jit
    def step(low, state, x):
        grads = jax.grad(_loss)(low, x.astype(jnp.bfloat16))  # bf16 grads are cast to fp32 inside
        updates, state = tx.update(grads, state, low)
        return optax.apply_updates(low, updates), state

    for i in range(3):
        low, state = step(low, state, _x(i))
    assert jax.tree.map(lambda x: x.dtype, low) == {"w": BF16, "b": BF16}
    assert _bits(low) == _bits(jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.master))
    with pytest.raises(StateError):
        tx.update(low, state)


# ---- dynamic loss scaling ----------------------------------------------------------------------------------------


def test_loss_scale_matches_plain_adam_on_finite_steps():
    scale = 2.0**12
    params, ref = _params(), _params()
    tx, ref_tx = dynamic_loss_scale(optax.adam(1e-2), init_scale=scale), optax.adam(1e-2)
    state, ref_state = tx.init(params), ref_tx.init(ref)
    for step in range(4):
        x = _x(step)
        grads = jax.grad(lambda p, x=x, state=state: scale_loss(_loss(p, x), state))(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = ref_tx.update(jax.grad(_loss)(ref, x), ref_state, ref)
        ref = optax.apply_updates(ref, ref_updates)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert float(state.scale) == scale and int(state.good_steps) == 4 and int(state.skipped) == 0


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_loss_scale_skips_non_finite_steps(bad):
    params = _params()
    tx = dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10)
    state = tx.init(params)
    grads = jax.grad(lambda p: scale_loss(_loss(p, _x(0)), state))(params)
    updates, state = tx.update(grads, state, params)  # one good step, so the Adam state is not all zeros
    params = optax.apply_updates(params, updates)
    before_params, before_inner = _bits(params), _bits(state.inner)

    grads = jax.grad(lambda p: scale_loss(_loss(p, _x(1)), state))(params)
    grads["b"] = grads["b"].at[3].set(bad)
    updates, new_state = tx.update(grads, state, params)
    assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, params)
    assert all(not bool(jnp.any(u)) for u in jax.tree.leaves(updates))
    assert _bits(optax.apply_updates(params, updates)) == before_params
    assert _bits(new_state.inner) == before_inner
    assert int(new_state.skipped) == int(state.skipped) + 1 == 1
    assert float(new_state.scale) == float(state.scale) / 2 and int(new_state.good_steps) == 0


def test_loss_scale_floor_growth_and_jit():
    params = {"w": jnp.ones((4,), jnp.float32)}
    tx = dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, growth_interval=3, min_scale=2.0)
    state = tx.init(params)
    step = jax.jit(tx.update)
    good, bad = {"w": jnp.full((4,), 8.0)}, {"w": jnp.array([1.0, jnp.nan, 1.0, 1.0])}
    scales = []
    for g in [bad, bad, good, good, good, good, good, good, bad]:
        _, state = step(g, state, params)
        scales.append(float(state.scale))
    assert scales == [2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 8.0, 4.0]
    assert int(state.skipped) == 3 and int(state.good_steps) == 0
    assert state.scale.dtype == F32 and state.good_steps.dtype == np.int32 and state.skipped.dtype == np.int32
    updates, _ = step(good, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 8.0 / 4.0)  # unscaled by 1/init_scale
    for kw in [dict(init_scale=0.0), dict(growth_interval=0), dict(factor=1.0), dict(min_scale=-1.0)]:
        with pytest.raises(PlanningError):
            dynamic_loss_scale(optax.sgd(0.1), **kw)
    with pytest.raises(StateError):
        tx.update(good, optax.sgd(0.1).init(params), params)


def test_find_and_scale_loss_search_nested_states():
    params = _params()
    assert find_loss_scale(optax.adam(1e-3).init(params)) is None
    assert float(scale_loss(jnp.float32(3.0), optax.adam(1e-3).init(params))) == 3.0
    nested = optax.chain(optax.clip_by_global_norm(1.0), dynamic_loss_scale(with_master_weights(optax.adam(1e-3)), 8.0))
    state = nested.init(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    found = find_loss_scale(state)
    assert isinstance(found, LossScaleState) and float(found.scale) == 8.0
    inside = with_master_weights(dynamic_loss_scale(optax.adam(1e-3), 16.0)).init(params)
    assert float(find_loss_scale(inside).scale) == 16.0
    assert float(scale_loss(jnp.float32(0.5), (None, {"opt": inside}))) == 8.0


def test_optimizer_for_policies():
    params = _params()
    assert isinstance(optimizer_for(optax.adam(1e-3), "fp32").init(params), tuple)
    assert find_loss_scale(optimizer_for(optax.adam(1e-3), "bf16").init(params)) is None
    assert isinstance(optimizer_for(optax.adam(1e-3), PRECISIONS["bf16_params"]).init(params), MasterWeightsState)
    assert isinstance(optimizer_for(optax.adam(1e-3), "fp16").init(params), LossScaleState)
    with pytest.raises(PlanningError):
        optimizer_for(optax.adam(1e-3), "int8")


def test_sharded_jit_step_keeps_shardings():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    params = {"w": jax.device_put(jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16), sharding)}
    tx = dynamic_loss_scale(with_master_weights(optax.adam(1e-2)), init_scale=2.0**8)
    state = jax.jit(tx.init)(params)
    assert state.inner.master["w"].sharding.is_equivalent_to(sharding, 1)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: scale_loss(jnp.sum(p["w"].astype(jnp.float32) ** 2), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state)
    params, state = step(params, state)
    assert params["w"].dtype == BF16 and params["w"].sharding.is_equivalent_to(sharding, 1)
    assert int(state.good_steps) == 2 and int(state.skipped) == 0
    assert _bits(params) == _bits(jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.inner.master))
