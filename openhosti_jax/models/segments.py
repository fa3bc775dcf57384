"""Packed sequences: several documents in one row of the batch, told apart by segment ids.

A batch's ``segment_ids`` ``(batch, seq)`` (integers, one per token, the same as ``tokens``' shape) give each token
its document; each document is a contiguous run of equal ids, and id 0 is padding (MaxText's convention). A packed
model call then behaves as the documents run one by one: a token attends to the earlier tokens of its own document
only (`segment_mask`, honoured by every attention path in `openhosti_jax.models.attention` and
`openhosti_jax.models.context`), its position restarts at 0 at its document's first token (`segment_positions`, for
learned positions and RoPE), and the next-token loss counts a target only where it is in the same document as its
input and not padding (`target_weights`).

Example:
    >>> import jax.numpy as jnp
    >>> seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    >>> segment_positions(seg).tolist()
    [[0, 1, 2, 0, 1, 0]]
    >>> target_weights(seg).tolist()  # targets 1..5: the 2nd doc's first token and the padding are not predicted
    [[1.0, 1.0, 0.0, 1.0, 0.0]]
    >>> segment_mask(seg, seg)[0, 3].tolist()  # the 4th token sees the 2nd document (the causal mask cuts later)
    [False, False, False, True, True, False]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from openhosti_jax.errors import BatchError


def check_segment_ids(segment_ids: Any, tokens_shape: tuple[int, ...]) -> jax.Array | None:
    """``segment_ids`` as an int32 array of ``tokens_shape`` (None passes); a `BatchError` for any other shape or a
    non-integer dtype."""
    if segment_ids is None:
        return None
    shape, dtype = tuple(np.shape(segment_ids)), jnp.result_type(segment_ids)
    if shape != tuple(tokens_shape) or not jnp.issubdtype(dtype, jnp.integer):
        raise BatchError(
            f"expected segment_ids of the tokens' shape {tuple(tokens_shape)} and an integer dtype (one document id "
            f"per token, 0 for padding), found shape {shape} {jnp.dtype(dtype).name}; pass "
            "batch['segment_ids'] with one id per token, e.g. numpy.repeat(doc_ids, doc_lengths) per row"
        )
    return jnp.asarray(segment_ids, jnp.int32)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """``(batch, seq)`` int32: each token's position within its run of equal ids (0 at a run's first token)."""
    s = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)


def segment_mask(q_ids: jax.Array, kv_ids: jax.Array) -> jax.Array:
    """``(batch, queries, keys)`` booleans: query and key in the same document."""
    return q_ids[:, :, None] == kv_ids[:, None, :]


def target_weights(segment_ids: jax.Array) -> jax.Array:
    """``(batch, seq - 1)`` float32 weights of the next-token targets ``1..seq-1``: 1 where the target is in its
    input's document and not padding (id 0), else 0."""
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    return (same & (segment_ids[:, 1:] != 0)).astype(jnp.float32)


__all__ = ["check_segment_ids", "segment_mask", "segment_positions", "target_weights"]
