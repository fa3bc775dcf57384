"""The recomputed activations and norms: the same values and gradients as plain autodiff, and only their inputs kept
for the backward, alone and inside the bundled models' blocks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from openhosti_jax.models import llama
from openhosti_jax.models.elementwise import gelu, rms_norm, swiglu
from openhosti_jax.models.llama import Block, Llama, LlamaConfig, rope_tables
from openhosti_jax.models.moe import MoEBlock, MoEConfig, moe_forward


def _rms_plain(x, w, eps, dtype):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype) * w.astype(dtype)


def _computed(f, *args):
    """Residuals ``f``'s backward keeps besides its arguments: [(shape, dtype)]."""
    return [(a.shape, a.dtype) for a, why in saved_residuals(f, *args) if "argument" not in why and a.shape]


CASES = {
    "swiglu": (lambda g, u: swiglu(g, u), lambda g, u: jax.nn.silu(g) * u, 2),
    "gelu_tanh": (lambda x: gelu(x), lambda x: jax.nn.gelu(x), 1),
    "gelu_erf": (lambda x: gelu(x, approximate=False), lambda x: jax.nn.gelu(x, approximate=False), 1),
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6, jnp.float32), lambda x, w: _rms_plain(x, w, 1e-6, jnp.float32), 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_and_gradients_equal_plain_autodiff_and_only_inputs_are_kept(name):
    lean, plain, n = CASES[name]
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.normal(size=(6, 16)), jnp.float32) for _ in range(n)]
    if name == "rms_norm":
        args[1] = args[1][0]
    cot = jnp.asarray(rng.normal(size=(6, 16)), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
    np.testing.assert_allclose(lean(*args), plain(*args), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.grad(loss(lean), range(n))(*args), jax.grad(loss(plain), range(n))(*args), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    total = lambda f: lambda *a: jnp.sum(f(*a))  # a loss whose own backward keeps nothing
    assert _computed(total(lean), *args) == []  # nothing computed from the inputs is kept
    assert _computed(total(plain), *args) != []  # plain autodiff keeps intermediates (why this module exists)


def test_a_bf16_llama_block_keeps_three_mlp_activations_per_token():
    """gate, up and their SwiGLU product (the down projection's input): as Megatron's fused SwiGLU, not the six
    copies plain autodiff keeps (silu's sigmoid and argument among them)."""
    ffn, tokens = 96, 32
    cfg = LlamaConfig.tiny(d_model=32, n_heads=4, n_kv_heads=2, ffn=ffn, seq_len=tokens, dtype="bfloat16")
    g, st = nnx.split(Block(cfg, rngs=nnx.Rngs(0)))
    cos, sin = rope_tables(tokens, cfg.head_dim, cfg.rope_theta)
    f = lambda st, x: jnp.sum(nnx.merge(g, st)(x, cos, sin).astype(jnp.float32))
    x = jnp.ones((1, tokens, 32), jnp.bfloat16)
    wide = [s for s, d in _computed(f, st, x) if s[:-1] == (1, tokens) and s[-1] == ffn]
    assert len(wide) == 3, wide


def test_a_bf16_moe_block_keeps_three_expert_activations_per_assignment_and_no_float32_copies():
    cfg = MoEConfig(d_model=32, d_ff=96, num_experts=4, top_k=2, dtype="bfloat16")
    w = MoEBlock(cfg, rngs=nnx.Rngs(0)).weights()
    x = jnp.asarray(np.random.default_rng(2).normal(size=(64, 32)), jnp.bfloat16)

    def f(w, x):
        y, aux = moe_forward(cfg, w, x)
        return jnp.sum(y.astype(jnp.float32)) + aux.loss

    kept = _computed(f, w, x)
    assert [s for s, _ in kept if s == (64 * 2, 96)] == [(128, 96)] * 3, kept
    assert not [s for s, d in kept if d == jnp.float32 and s[-1] == 32], kept  # no float32 copy of a d_model row


def _llama_grad():
    cfg = LlamaConfig.tiny(d_model=128, n_heads=2, n_kv_heads=1, ffn=512, seq_len=32, n_layers=3, dtype="bfloat16")
    g, p = nnx.split(Llama(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (16, cfg.seq_len)), jnp.int32)
    grad = jax.jit(jax.grad(lambda p: jnp.mean(nnx.merge(g, p)(tokens))))
    return grad.lower(p).compile().memory_analysis().temp_size_in_bytes, grad(p)


def test_a_scanned_bf16_llamas_compiled_gradient_holds_less_than_with_plain_autodiffs(monkeypatch):
    """What XLA allocates, not only what the trace keeps. A scanned stack's residuals leave the loop as stacked
    arrays, so XLA cannot fuse them away as it does some in straight-line code: there the recomputed activations
    and norms are what fused kernels save."""
    lean, want = _llama_grad()
    monkeypatch.setattr(llama, "swiglu", lambda g, u: jax.nn.silu(g) * u)
    monkeypatch.setattr(llama, "rms_norm", _rms_plain)
    jax.clear_caches()  # nnx.scan keeps the traced block: trace it again with the plain functions
    try:
        plain, got = _llama_grad()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert lean < 0.85 * plain, (lean, plain)  # 0.70 on XLA:CPU, jax 0.10.2
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0.02, atol=2e-3)
