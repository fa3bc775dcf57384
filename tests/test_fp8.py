"""Precision "fp8": the matmul is the dot of the operands rounded to fp8 at their current scale (forward e4m3,
output gradient e5m2), it replaces the repeated blocks' linear layers only, the planner prices it at the profile's
fp8 rate and takes it only where allowed, and a backend that cannot run it is refused by name."""

import dataclasses
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from openhosti_jax.errors import ConfigError, PlanningError
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.planner.choose import fp8_refusal
from openhosti_jax.planner.cluster import Cluster
from openhosti_jax.planner.predict import predict
from openhosti_jax.planner.profiles import PROFILES
from openhosti_jax.planner.search import precision_options
from openhosti_jax.policies.fp8 import device_fp8_problem, fp8_dot_general, fp8_problem
from openhosti_jax.policies.precision import PRECISIONS, state_bytes_per_param
from openhosti_jax.state.context import active_policies
from openhosti_jax.state.model import model_parts

DIMS = (((1,), (0,)), ((), ()))
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def rounded(x, dtype):
    """``x`` rounded to ``dtype`` at the scale that puts its largest magnitude on the format's largest (numpy)."""
    x = np.asarray(x, np.float32)
    scale = np.float32(jnp.asarray(np.abs(x).max() / float(jnp.finfo(dtype).max), jnp.bfloat16))
    return np.asarray(jnp.asarray(x / scale).astype(dtype).astype(np.float32)) * scale


def test_the_fp8_matmul_is_the_dot_of_the_rounded_operands_forward_and_backward():
    x = jax.random.normal(jax.random.key(0), (8, 16), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (16, 4), jnp.bfloat16) * 0.1
    g = jax.random.normal(jax.random.key(2), (8, 4), jnp.bfloat16)
    out, (dx, dw) = jax.jit(
        lambda a, b, g: (lambda o, f: (o, f(g)))(*jax.vjp(lambda a, b: fp8_dot_general(a, b, DIMS), a, b))
    )(x, w, g)
    xq, wq, gq = rounded(x, E4M3), rounded(w, E4M3), rounded(g, E5M2)
    np.testing.assert_allclose(np.asarray(out, np.float32), xq @ wq, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dx, np.float32), gq @ wq.T, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dw, np.float32), xq.T @ gq, rtol=1e-2, atol=2e-2)
    assert out.dtype == dx.dtype == jnp.bfloat16
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)  # and it is a matmul, to e4m3's resolution
    assert np.abs(np.asarray(out, np.float32) - exact).max() < 0.1 * np.abs(exact).max()


def _converts(jaxpr, dtype) -> int:
    found = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == dtype:
            found += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _converts(sub, dtype)
    return found


def test_fp8_takes_the_blocks_linear_layers_and_leaves_the_head_alone():
    parts = model_parts(lambda r: GPT(GPTConfig.tiny(), rngs=nnx.Rngs(r)), jax.random.key(0))
    tokens = jnp.zeros((2, 16), jnp.int32)

    def forward(params):
        with active_policies("none", "fp8"):
            return parts.apply_fn(params, tokens)

    jaxpr = jax.make_jaxpr(forward)(parts.params).jaxpr
    assert _converts(jaxpr, np.dtype(E4M3)) == 2 * 4 * 2  # 2 blocks x (qkv, proj, fc, out) x (input, weight)
    with active_policies("none", "bf16"):
        bf16 = jax.make_jaxpr(lambda p: parts.apply_fn(p, tokens))(parts.params).jaxpr
    assert _converts(bf16, np.dtype(E4M3)) == 0


def test_fp8_keeps_fp32_master_weights_in_the_state():
    p = PRECISIONS["fp8"]
    assert (p.param_dtype, p.compute_dtype, p.fp8_matmuls) == (np.float32, jnp.bfloat16, True)
    assert state_bytes_per_param(p, 0, 1) == state_bytes_per_param(PRECISIONS["bf16"], 0, 1) == 12.0


def test_a_backend_that_cannot_run_fp8_is_refused_naming_those_that_can():
    assert fp8_problem("cpu") is None and fp8_problem("gpu", "NVIDIA H100", "9.0") is None
    for device in (("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), ("tpu", "TPU v5p", None)):
        problem = device_fp8_problem(
            types.SimpleNamespace(
                platform=device[0], device_kind=device[1], **({"compute_capability": device[2]} if device[2] else {})
            )
        )
        assert "compute capability 8.9 or later" in problem and "H100" in problem and device[1] in problem
    assert "H100" in fp8_refusal([], PROFILES["A100"]) and "TPU v5p" in fp8_refusal([], PROFILES["TPU v5p"])
    assert fp8_refusal([], PROFILES["H100"]) is None and fp8_refusal(jax.devices()[:1], PROFILES["A100"]) is None


GPT_SMALL = GPTConfig(n_layers=2, d_model=256, n_heads=4, seq_len=128, vocab_size=512)
BATCH = jax.ShapeDtypeStruct((16, 128), jnp.int32)


def _init(r):
    return GPT(GPT_SMALL, rngs=nnx.Rngs(r))


def test_the_planner_prices_fp8_matmuls_at_the_fp8_rate():
    h100 = PROFILES["H100"]
    run = {"mesh": "data=8", "zero": 0}

    def compute(profile, precision):
        return predict(_init, optax.adamw(1e-4), BATCH, Cluster(profile, 1, 8), precision=precision, **run)

    bf16, fp8 = compute(h100, "bf16"), compute(h100, "fp8")
    same = compute(dataclasses.replace(h100, fp8_flops=h100.peak_flops), "fp8")
    assert same.time["compute"] == pytest.approx(bf16.time["compute"], rel=1e-9)  # only the rate differs
    assert 0.5 * bf16.time["compute"] < fp8.time["compute"] < 0.75 * bf16.time["compute"]  # attention stays bf16


def test_the_planner_takes_fp8_only_where_allowed():
    one = Cluster(PROFILES["H100"], 1, 1)  # no collectives: the matmuls decide
    chosen = predict(_init, optax.adamw(1e-4), BATCH, one, precision=("bf16", "fp8"), pipeline=False)
    bf16 = predict(_init, optax.adamw(1e-4), BATCH, one, precision="bf16", pipeline=False)
    assert chosen.plan.precision == "fp8" and chosen.step_seconds < bf16.step_seconds
    assert "fp8" not in precision_options("auto")  # the default never takes it: it must be named
    with pytest.raises(PlanningError, match="compute capability 8.9"):
        predict(_init, optax.adamw(1e-4), BATCH, "8xA100", precision=("bf16", "fp8"), pipeline=False)


def test_a_step_on_a_backend_without_fp8_is_a_typed_error(monkeypatch):
    import openhosti_jax as oh
    from openhosti_jax.state import jit as jit_module

    mesh = oh.build_mesh(oh.MeshConfig(data=1), jax.devices()[:1])
    state, plan = oh.create_train_state(lambda r: {"w": jnp.zeros((4, 4))}, optax.sgd(0.1), mesh, plan="dp")
    monkeypatch.setattr(jit_module, "device_fp8_problem", lambda d: fp8_problem("tpu", "TPU v5p"))
    with pytest.raises(ConfigError, match="precision='fp8' runs its matmuls in fp8 on NVIDIA GPUs"):
        jit_module.jit_step(lambda s, b: (s, {}), dataclasses.replace(plan, precision="fp8"), mesh, state, {})
