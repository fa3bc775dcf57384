"""Causal attention for the bundled models, and over blocks of queries, each block's scores made and freed in turn
and recomputed in the backward pass: the ``seq x seq`` score matrix is never held whole, so activations grow with
the sequence length, not its square (what flash attention achieves with a fused kernel; here plain XLA ops under
`jax.checkpoint`).

`causal_attention` is the models' one entry: the sequence split over a ``context`` mesh axis
(`openhosti_jax.models.context`) where the ambient mesh has one, else `query_blocks` where a block size is given,
else `jax.nn.dot_product_attention`.

Example:
    >>> import jax, jax.numpy as jnp
    >>> q = jax.random.normal(jax.random.key(0), (2, 8, 4))  # (batch, seq, features)
    >>> def attend(qb, first):  # causal mean of the values up to each query, for queries first, first + 1, ...
    ...     keep = (first + jnp.arange(qb.shape[1]))[:, None] >= jnp.arange(8)[None, :]
    ...     w = keep / keep.sum(-1, keepdims=True)
    ...     return jnp.einsum("qk,bkf->bqf", w, q)
    >>> bool(jnp.allclose(query_blocks(attend, q, 2), attend(q, 0), atol=1e-6))
    True
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from openhosti_jax.errors import ConfigError
from openhosti_jax.models.context import Strategy, context_attention, context_size


def causal_mask(first: jax.Array | int, queries: int, keys: int) -> jax.Array:
    """``(queries, keys)`` booleans: query ``first + i`` sees keys up to its own position."""
    return (first + jnp.arange(queries))[:, None] >= jnp.arange(keys)[None, :]


def query_blocks(attend: Callable[[jax.Array, jax.Array], jax.Array], q: jax.Array, block: int | None) -> jax.Array:
    """``attend(q, 0)`` computed ``block`` queries at a time (``q``: batch, then sequence), each block under
    `jax.checkpoint` so that only its inputs are kept for the backward. ``attend(q_block, first)`` gets the block
    and the position of its first query. ``block`` None (or the whole sequence): one call."""
    s = q.shape[1]
    if block is None or block >= s:
        return attend(q, jnp.asarray(0))
    if s % block:
        raise ConfigError(f"attention_block={block} must divide the sequence length {s}; use a divisor of it")
    n = s // block
    blocks = jnp.moveaxis(q.reshape(q.shape[0], n, block, *q.shape[2:]), 1, 0)
    step = jax.checkpoint(lambda qb, first: attend(qb, first))
    out = jax.lax.map(lambda a: step(*a), (blocks, jnp.arange(n) * block))
    return jnp.moveaxis(out, 0, 1).reshape(*q.shape[:2], *out.shape[3:])


KERNELS = ("auto", "xla", "cudnn")
"""Attention kernels a model may ask for: ``"auto"`` (the fused one the backend has, else XLA's), ``"xla"``,
``"cudnn"`` (cuDNN's fused flash attention: GPU, half precision)."""


def attention_kernel(kernel: str, dtype: jnp.dtype, head_dim: int, backend: str | None = None) -> str:
    """The kernel ``"xla"`` or ``"cudnn"`` that attention of ``dtype`` and ``head_dim`` runs on ``backend`` (default:
    JAX's) for a request of ``kernel`` (`KERNELS`). ``"auto"`` takes cuDNN's fused attention on a GPU in bf16 or
    fp16 with a head dim it supports (a multiple of 8, at most 128), since jax's own default
    (``implementation=None``) is XLA's on every backend; a TPU runs XLA's (a Pallas splash kernel is not wired here).
    A kernel the backend does not have is a `ConfigError`.

    >>> import jax.numpy as jnp
    >>> attention_kernel("auto", jnp.bfloat16, 128, "gpu"), attention_kernel("auto", jnp.float32, 128, "gpu")
    ('cudnn', 'xla')
    >>> attention_kernel("auto", jnp.bfloat16, 128, "cpu")
    'xla'
    """
    backend = backend or jax.default_backend()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    supported = backend == "gpu" and half and head_dim % 8 == 0 and head_dim <= 128
    if kernel == "auto":
        return "cudnn" if supported else "xla"
    if kernel == "cudnn" and not supported:
        raise ConfigError(
            "attention_kernel='cudnn' needs cuDNN's fused attention: a GPU backend, bf16 or fp16, a head dim that is "
            f"a multiple of 8 up to 128; found backend {backend!r}, {jnp.dtype(dtype).name}, head dim {head_dim}. Use "
            "'auto' (the fused kernel where the backend has one) or 'xla'"
        )
    if kernel not in KERNELS:
        raise ConfigError(f"attention_kernel={kernel!r}: expected one of {KERNELS}")
    return kernel


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    block: int | None = None,
    context_strategy: Strategy = "ring",
    kernel: str = "auto",
) -> jax.Array:
    """Causal grouped-query attention of ``q`` ``(batch, seq, heads, head_dim)`` over ``k``, ``v`` ``(batch, seq,
    kv_heads, head_dim)`` (query head ``h`` reads kv head ``h // (heads // kv_heads)``), scaled by ``head_dim **
    -0.5``; the output is laid out like ``q``.

    Under an ambient mesh (`jax.set_mesh`) with a ``context`` axis larger than 1: `context_attention` by
    ``context_strategy`` (``block`` unused: its pieces are the blocks). Else where `attention_kernel` picks cuDNN
    (``kernel="auto"`` on a GPU in half precision): `jax.nn.dot_product_attention` on it, ``block`` unused. Else
    with ``block``: `query_blocks` of that many queries, scores and softmax in float32. Else
    `jax.nn.dot_product_attention`'s XLA implementation.

    >>> import jax, jax.numpy as jnp
    >>> q = jax.random.normal(jax.random.key(0), (1, 8, 4, 2))
    >>> kv = jax.random.normal(jax.random.key(1), (1, 8, 2, 2))
    >>> bool(jnp.allclose(causal_attention(q, kv, kv, block=2), causal_attention(q, kv, kv), atol=1e-6))
    True
    """
    if context_size() > 1:
        return context_attention(q, k, v, strategy=context_strategy)
    if attention_kernel(kernel, q.dtype, q.shape[-1]) == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if block is None or block >= q.shape[1]:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    b, s, h, d = q.shape
    kvh = k.shape[2]
    grouped = q.reshape(b, s, kvh, h // kvh, d)

    def attend(qb: jax.Array, first: jax.Array) -> jax.Array:
        att = jnp.einsum("bqngd,bknd->bngqk", qb, k, preferred_element_type=jnp.float32) * d**-0.5
        att = jnp.where(causal_mask(first, qb.shape[1], s), att, jnp.finfo(att.dtype).min)
        return jnp.einsum("bngqk,bknd->bqngd", jax.nn.softmax(att, axis=-1).astype(v.dtype), v)

    return query_blocks(attend, grouped, block).reshape(q.shape)
