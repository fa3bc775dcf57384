"""ZeRO 0-3 on 8 devices: compiled per-device state bytes vs the closed-form formula, losses vs one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.train import create_train_state, spmd

D, H, B = 128, 512, 16


def init_fn(rng):
    k1, k2 = jax.random.split(rng)
    return {
        "w1": jax.random.normal(k1, (D, H)) / np.sqrt(D),
        "w2": jax.random.normal(k2, (H, D)) / np.sqrt(H),
        "b": jnp.zeros((H,)),
    }


def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def step(state, batch):
    value, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def batches(n):
    rs = np.random.default_rng(0)
    return [
        {"x": rs.normal(size=(B, D)).astype(np.float32), "y": rs.normal(size=(B, D)).astype(np.float32)}
        for _ in range(n)
    ]


def formula(stage, p_bytes, n):
    """fp32 params + fp32 grads + Adam (mu, nu): bytes per device."""
    params, grads, opt = p_bytes, p_bytes, 2 * p_bytes
    return {
        0: params + grads + opt,
        1: params + grads + opt / n,
        2: params + (grads + opt) / n,
        3: (params + grads + opt) / n,
    }[stage]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_match_formula_and_losses_match_one_device(stage):
    tx = optax.adam(1e-2)
    mesh = build_mesh(MeshConfig(data=1, fsdp=8))
    state, plan = create_train_state(init_fn, tx, mesh, plan=stage)
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    p_bytes = sum(x.size * 4 for x in jax.tree.leaves(abstract))
    data = batches(3)

    train = spmd(step, mesh=mesh, plan=plan)
    ma = train.lower(state, data[0]).compile().memory_analysis()
    batch_bytes = sum(x.nbytes for x in data[0].values()) // 8
    state_args = ma.argument_size_in_bytes - batch_bytes
    param_sh = plan.shardings(mesh, plan.param_specs)
    grad_sh = plan.shardings(mesh, plan.grad_specs)
    batch_sh = plan.batch_shardings(mesh, data[0])
    grads_fn = jax.jit(jax.grad(loss_fn), in_shardings=(param_sh, batch_sh), out_shardings=grad_sh)
    with jax.set_mesh(mesh):
        grad_bytes = grads_fn.lower(abstract, data[0]).compile().memory_analysis().output_size_in_bytes
    measured = state_args + grad_bytes
    expected = formula(stage, p_bytes, 8)
    assert abs(measured / expected - 1) < 0.10, (stage, measured, expected)

    one = build_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    ref_state, ref_plan = create_train_state(init_fn, tx, one, plan=0)
    ref_train = spmd(step, mesh=one, plan=ref_plan)
    for b in data:
        state, m = train(state, b)
        ref_state, rm = ref_train(ref_state, b)
        assert abs(float(m["loss"]) - float(rm["loss"])) < 1e-5
    for a, r in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-3
        )  # Adam: lr-sized steps on ~0 grads


def test_zero_specs_shard_opt_state_by_stage():
    tx = optax.adam(1e-3)
    params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
    for stage, (p, o) in {0: (None, None), 1: (None, "fsdp"), 3: ("fsdp", "fsdp")}.items():
        plan = ShardingPlan.from_zero(params, tx, {"fsdp": 8}, stage)
        assert plan.param_specs["w"][0] == p
        assert plan.opt_specs[0].mu["w"][0] == o


def test_multi_transform_state_is_sharded_like_its_parameters():
    """optax.multi_transform's inner states hold masked parameter trees; each moment still gets its parameter's spec
    (found by path), the counts stay replicated."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from openhosti_jax.sharding.zero import zero_specs

    params = {"w": jax.ShapeDtypeStruct((64, 128), jnp.float32), "b": jax.ShapeDtypeStruct((128,), jnp.float32)}
    tx = optax.multi_transform({"a": optax.adam(1e-3), "s": optax.sgd(0.1)}, {"w": "a", "b": "s"})
    p_specs, _, o_specs = zero_specs(params, tx, {"data": 8}, 3, min_elements=1)
    adam = o_specs.inner_states["a"].inner_state[0]
    assert adam.mu["w"] == p_specs["w"] and adam.nu["w"] == p_specs["w"] and p_specs["w"] != P(None, None)
    assert adam.count == P()
