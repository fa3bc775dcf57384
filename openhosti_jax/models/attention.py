"""Causal attention over blocks of queries, each block's scores made and freed in turn and recomputed in the
backward pass: the ``seq x seq`` score matrix is never held whole, so activations grow with the sequence length,
not its square (what flash attention achieves with a fused kernel; here plain XLA ops under `jax.checkpoint`).

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
