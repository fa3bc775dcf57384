"""The recomputed pieces: the same values and gradients as plain autodiff, only their inputs kept for the backward,
and what a scanned mixture-of-experts model's compiled gradient holds with them."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from openhosti_jax.models import moe
from openhosti_jax.models.elementwise import recomputed, swiglu
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.models.moe import MoEBlock, MoEConfig, moe_forward


def _computed(f, *args):
    """Residuals ``f``'s backward keeps besides its arguments: [(shape, dtype)]."""
    return [(a.shape, a.dtype) for a, why in saved_residuals(f, *args) if "argument" not in why and a.shape]


def test_swiglu_equals_plain_autodiff_and_keeps_only_its_inputs():
    rng = np.random.default_rng(0)
    g, u, cot = (jnp.asarray(rng.normal(size=(6, 16)), jnp.float32) for _ in range(3))
    plain = lambda g, u: jax.nn.silu(g) * u
    np.testing.assert_allclose(swiglu(g, u), plain(g, u), rtol=1e-6, atol=1e-6)
    weighted = lambda f: lambda g, u: jnp.sum(f(g, u) * cot)
    for a, b in zip(jax.grad(weighted(swiglu), (0, 1))(g, u), jax.grad(weighted(plain), (0, 1))(g, u), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    total = lambda f: lambda g, u: jnp.sum(f(g, u))  # a loss whose own backward keeps nothing
    assert _computed(total(swiglu), g, u) == []
    assert _computed(total(plain), g, u) != []  # plain autodiff keeps intermediates (why this module exists)


def test_a_recomputed_float32_cast_keeps_the_bf16_input_not_the_float32_copy():
    x = jnp.ones((8, 4), jnp.bfloat16)
    w = jnp.ones((4, 2), jnp.float32)
    logits = lambda x, w: jnp.sum(jnp.tanh(x.astype(jnp.float32) @ w))
    assert any(d == jnp.float32 and s == (8, 4) for s, d in _computed(logits, x, w))
    assert not any(s == (8, 4) for s, _ in _computed(lambda x, w: jnp.sum(jnp.tanh(recomputed(
        lambda x, w: x.astype(jnp.float32) @ w)(x, w))), x, w))  # fmt: skip


def test_a_bf16_moe_block_keeps_three_expert_activations_per_assignment_and_no_float32_copies():
    cfg = MoEConfig(d_model=32, d_ff=96, num_experts=4, top_k=2, dtype="bfloat16")
    w = MoEBlock(cfg, rngs=nnx.Rngs(0)).weights()
    x = jnp.asarray(np.random.default_rng(2).normal(size=(64, 32)), jnp.bfloat16)

    def f(w, x):
        y, aux = moe_forward(cfg, w, x)
        return jnp.sum(y.astype(jnp.float32)) + aux.loss

    kept = _computed(f, w, x)
    assert [s for s, _ in kept if s == (64 * 2, 96)] == [(128, 96)] * 3, kept  # gate, up and their product
    assert not [s for s, d in kept if d == jnp.float32 and s[-1] == 32], kept  # no float32 copy of a d_model row


def _moe_llama_grad():
    cfg = LlamaConfig.tiny(
        d_model=64, n_heads=2, n_kv_heads=1, seq_len=32, n_layers=3, num_experts=4, top_k=2, moe_ffn=256,
        dtype="bfloat16", scan_layers=True,
    )  # fmt: skip
    g, p = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (8, cfg.seq_len)), jnp.int32)

    def loss(p):
        logits, aux = nnx.merge(g, p)(tokens, with_aux=True)
        return jnp.mean(logits) + jnp.sum(aux.loss)

    grad = jax.jit(jax.grad(loss))
    return grad.lower(p).compile().memory_analysis().temp_size_in_bytes, grad(p)


def test_a_scanned_bf16_moe_llamas_compiled_gradient_holds_less_than_with_plain_autodiff(monkeypatch):
    """What XLA allocates, not only what the trace keeps: a scanned stack's residuals leave the loop as stacked
    arrays, which XLA's fusion cannot recompute on its own."""
    lean, want = _moe_llama_grad()
    monkeypatch.setattr(moe, "swiglu", lambda g, u: jax.nn.silu(g) * u)
    monkeypatch.setattr(moe, "recomputed", lambda f: f)
    jax.clear_caches()  # nnx.scan keeps the traced block: trace it again with the plain functions
    try:
        plain, got = _moe_llama_grad()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert lean < 0.9 * plain, (lean, plain)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0.02, atol=2e-3)
