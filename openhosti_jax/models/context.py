"""Context parallelism: causal attention over sequences split along their length over the mesh's ``context`` axis.

`context_attention` takes ``q`` ``(batch, seq, heads, head_dim)`` and ``k``, ``v`` ``(batch, seq, kv_heads,
head_dim)`` (grouped-query: query head ``h`` reads key/value head ``h // (heads // kv_heads)``), split along ``seq``
into contiguous pieces over ``context`` as a ``(batch, seq)`` token batch is
(`openhosti_jax.sharding.plan.batch_spec_for`), and returns the attention output laid out like ``q``. Inside
`jax.shard_map` each device holds its queries and one of two strategies brings it the keys and values it needs:

- ``"ring"`` (ring attention, Liu et al. 2023; Megatron's and MaxText's context parallelism): the keys and values
  travel round the ring of ``context`` devices by `jax.lax.ppermute`, one hop per step, and each step's partial
  result is merged into the running one with an online (log-sum-exp) softmax, so no device ever holds the whole
  sequence's keys at once in the forward.
- ``"all_gather"``: every device gathers the whole sequence's keys and values (`jax.lax.all_gather`) and attends
  its contiguous queries to them, masked by their true positions (fewer, larger messages; the full ``seq`` keys per
  device).

Causal load balancing (ring): with contiguous pieces the last device's queries see the whole sequence and the
first's only their own piece. The ring cuts the sequence into ``2 n`` chunks and device ``i`` holds chunks ``i``
and ``2n - 1 - i`` (`shard_positions`), so every device has the same number of unmasked ``(query, key)`` pairs. The
permutation is applied inside the attention only: two `ppermute` of half a piece move the contiguous pieces into
the balanced order on the way in (queries, keys and values together) and two move the output back on the way
out, so the rest of the model, its positions (RoPE, learned embeddings), its logits and its loss never see it
(permuting the tokens once at the model's input would save these exchanges in every layer, at the price of every
model carrying permuted positions and un-permuting its logits).
In the balanced order every ring step is the same work on every device: at step ``t`` device ``i`` holds the keys of
device ``j = i - t (mod n)``; its second query chunk sees the whole of ``j``'s first key chunk, and either its first
query chunk sees that same key chunk (``j < i``) or its second query chunk sees ``j``'s second key chunk
(``j > i``); the other blocks are wholly masked and never computed. The step on its own keys computes three chunk
blocks, two of them causal.

Gradients come from JAX's autodiff through the `shard_map` (the transpose of a `ppermute` is the reverse
`ppermute`, of an `all_gather` a reduce-scatter); each block's scores are recomputed in the backward
(`jax.checkpoint`), so what a device keeps for the backward is the keys and values of every ring step, i.e. the
whole sequence's (as the all-gather strategy does), not their scores. A hand-written backward that passes the keys
and values round the ring again (ring attention's own) would keep one piece; it is not done here.

Each device's blocks are XLA's einsums (``kernel="xla"``) or, on a TPU, the Pallas splash kernel
(``kernel="splash"``, `openhosti_jax.models.splash`): the ring's blocks by `splash_stats`, whose log-sum-exp the
merge above differentiates (the kernel's backward, not a recomputation, gives each block's gradients; a ring step
then also keeps its block's output and log-sum-exp for the backward), and the all-gather strategy's local queries
over the gathered keys by one kernel whose causal block mask is split over the axis with the queries, so the
blocks above the diagonal are skipped there too.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.mesh import MeshConfig, build_mesh
    >>> mesh = build_mesh(MeshConfig.from_sizes({"context": 4}), jax.devices()[:4])
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))
    >>> with jax.set_mesh(mesh):
    ...     out = jax.jit(context_attention)(q, k, v)
    >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
    True
    >>> shard_positions(8, 2).tolist()  # device 0 holds chunks 0 and 3 of 4, device 1 chunks 1 and 2
    [[0, 1, 6, 7], [2, 3, 4, 5]]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import ConfigError, ShardingError
from openhosti_jax.mesh.config import SEQUENCE_AXIS
from openhosti_jax.models.local import over_mesh, tensor_ways
from openhosti_jax.models.segments import segment_mask
from openhosti_jax.models.splash import gathered_kernel, splash_attention, splash_problem, splash_stats

Strategy = Literal["ring", "all_gather"]
"""How a device gets the keys and values of the other sequence pieces."""

STRATEGIES: tuple[str, ...] = ("ring", "all_gather")
"""Every `Strategy`."""

Stats = tuple[jax.Array, jax.Array, jax.Array]
"""An online-softmax partial result: (row max ``(b, q, n, g)``, row sum of exponentials, unnormalised output
``(b, q, n, g, d)``), all float32."""

Attend = Callable[[jax.Array, jax.Array, jax.Array, bool, Any], Stats]
"""``attend(q, k, v, causal, segments)``: the `Stats` of grouped queries ``(b, q, n, g, d)`` over keys and values
``(b, k, n, d)``, all visible or (``causal``) query ``i`` over keys ``0..i``, and (``segments``: ``(query ids (b, q),
key ids (b, k))``, else None) only keys of the query's own segment. A row that sees no key weighs nothing once
merged with one that does (every query sees itself in the ring's first step)."""


def context_size(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None, axis: str = SEQUENCE_AXIS) -> int:
    """The size of ``axis`` of ``mesh`` (default: the ambient mesh set by `jax.set_mesh`) that a sequence can be split
    over: 1 when there is no mesh, no such axis, or the axis is already manual (inside a `jax.shard_map` over it).

    >>> context_size()  # no ambient mesh
    1
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty or axis not in mesh.axis_names or axis in getattr(mesh, "manual_axes", ()):
        return 1
    return int(dict(mesh.shape)[axis])


def shard_positions(seq_len: int, shards: int, balanced: bool = True) -> np.ndarray:
    """``(shards, seq_len // shards)``: the true positions each device's piece holds, in order. ``balanced``: the
    ring's layout (chunks ``i`` and ``2 shards - 1 - i`` of ``2 shards``); else contiguous pieces."""
    if shards < 1 or seq_len % (2 * shards if balanced else shards):
        raise ShardingError(
            f"expected a sequence length divisible by {2 * shards if balanced else shards} "
            f"({'2 x ' if balanced else ''}{shards} shards), found {seq_len}"
        )
    if not balanced:
        return np.arange(seq_len).reshape(shards, -1)
    chunks = np.arange(seq_len).reshape(2 * shards, -1)
    return np.stack([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def _owner(chunk: int, n: int) -> int:
    """The device that holds ``chunk`` of ``2 n`` in the balanced layout."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _to_balanced(x: jax.Array, axis: str, n: int) -> jax.Array:
    """Local ``x`` (b, 2c, ...) holding chunks ``2i, 2i+1`` -> chunks ``i, 2n-1-i``. Device ``k``'s first half goes to
    the owner of chunk ``2k``, its second to the owner of ``2k + 1`` (each a permutation of the devices); an even
    device receives its first chunk by the first exchange, an odd one by the second."""
    c = x.shape[1] // 2
    first = jax.lax.ppermute(x[:, :c], axis, [(k, _owner(2 * k, n)) for k in range(n)])
    second = jax.lax.ppermute(x[:, c:], axis, [(k, _owner(2 * k + 1, n)) for k in range(n)])
    even = jax.lax.axis_index(axis) % 2 == 0
    return jnp.concatenate([jnp.where(even, first, second), jnp.where(even, second, first)], axis=1)


def _from_balanced(x: jax.Array, axis: str, n: int) -> jax.Array:
    """The inverse of `_to_balanced`: local chunks ``i, 2n-1-i`` -> ``2i, 2i+1``."""
    c = x.shape[1] // 2
    even = jax.lax.axis_index(axis) % 2 == 0
    a, b = x[:, :c], x[:, c:]
    first = jax.lax.ppermute(jnp.where(even, a, b), axis, [(_owner(2 * k, n), k) for k in range(n)])
    second = jax.lax.ppermute(jnp.where(even, b, a), axis, [(_owner(2 * k + 1, n), k) for k in range(n)])
    return jnp.concatenate([first, second], axis=1)


@jax.checkpoint
def _block(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float) -> Stats:
    """The online-softmax partial result of queries ``q`` (b, q, n, g, d) over keys/values (b, k, n, d), ``mask``
    (q, k) or (b, q, k), or None (all visible). A row that sees no key has the float32 minimum as its max, so a
    merge with a row that sees one gives it no weight."""
    s = jnp.einsum("bqngd,bknd->bqngk", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        mask = mask if mask.ndim == 3 else mask[None]
        s = jnp.where(mask[:, :, None, None, :], s, jnp.finfo(jnp.float32).min)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))  # the result does not depend on the shift
    p = jnp.exp(s - m[..., None])
    out = jnp.einsum("bqngk,bknd->bqngd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=-1), out


def _merge(a: Stats, b: Stats) -> Stats:
    """Two partial results of the same queries over disjoint keys, as one."""
    m = jnp.maximum(a[0], b[0])
    ea, eb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, a[1] * ea + b[1] * eb, a[2] * ea[..., None] + b[2] * eb[..., None]


def _finish(stats: Stats, dtype: jnp.dtype) -> jax.Array:
    return (stats[2] / stats[1][..., None]).astype(dtype)


def _select(pred: jax.Array, a: Stats, b: Stats) -> Stats:
    return tuple(jnp.where(pred, x, y) for x, y in zip(a, b, strict=True))  # type: ignore[return-value]


def _xla_block(scale: float) -> Attend:
    """`_block` as an `Attend`: a causal block masked by its lower triangle, and by the segments where given."""

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, segments: Any = None) -> Stats:
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)) if causal else None
        if segments is not None:
            same = segment_mask(*segments)
            mask = same if mask is None else same & mask[None]
        return _block(q, k, v, mask, scale)

    return attend


def _splash_block(scale: float, interpret: bool) -> Attend:
    """`splash_stats` as an `Attend`."""

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, segments: Any = None) -> Stats:
        return splash_stats(q, k, v, causal, scale, interpret, segments)

    return attend


def _ring(
    q: jax.Array, k: jax.Array, v: jax.Array, axis: str, n: int, attend: Attend, seg: jax.Array | None = None
) -> jax.Array:
    """Causal attention of the local balanced pieces (chunks ``i``, ``2n-1-i``) with keys/values round the ring,
    each block by ``attend``; ``seg``: the local tokens' segment ids (b, 2c), which travel with the keys."""
    c = q.shape[1] // 2
    qa, qb = q[:, :c], q[:, c:]
    sa, sb = (None, None) if seg is None else (seg[:, :c], seg[:, c:])

    def ids(qs: jax.Array | None, ks: jax.Array | None) -> Any:
        return None if qs is None else (qs, ks)

    a = attend(qa, k[:, :c], v[:, :c], True, ids(sa, sa))  # chunk i over itself
    b = _merge(attend(qb, k[:, :c], v[:, :c], False, ids(sb, sa)), attend(qb, k[:, c:], v[:, c:], True, ids(sb, sb)))
    i = jax.lax.axis_index(axis)

    def step(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
        k, v, ks, a, b = carry
        k, v, ks = jax.lax.ppermute((k, v, ks), axis, [(j, (j + 1) % n) for j in range(n)])  # now device i - t's
        ka, va, kb, vb = k[:, :c], v[:, :c], k[:, c:], v[:, c:]
        ksa, ksb = (None, None) if ks is None else (ks[:, :c], ks[:, c:])
        b = _merge(b, attend(qb, ka, va, False, ids(sb, ksa)))  # chunk 2n-1-i sees all of chunk i - t (mod n)
        earlier = t <= i  # keys of a device before this one: its first chunk is before both of ours
        pick = functools.partial(jnp.where, earlier)
        part = attend(
            pick(qa, qb), pick(ka, kb), pick(va, vb), False, None if seg is None else (pick(sa, sb), pick(ksa, ksb))
        )
        merged = _merge(_select(earlier, a, b), part)
        return (k, v, ks, _select(earlier, merged, a), _select(earlier, b, merged)), None

    (_, _, _, a, b), _ = jax.lax.scan(step, (k, v, seg, a, b), jnp.arange(1, n))
    return jnp.concatenate([_finish(a, q.dtype), _finish(b, q.dtype)], axis=1)


def _gathered(
    q: jax.Array, k: jax.Array, v: jax.Array, axis: str, n: int, scale: float, seg: jax.Array | None = None
) -> jax.Array:
    """Causal attention of the local contiguous piece over the whole sequence's gathered keys/values (and, with
    ``seg``, their gathered segment ids)."""
    size = q.shape[1]
    k, v = (jax.lax.all_gather(t, axis, axis=1, tiled=True) for t in (k, v))
    first = jax.lax.axis_index(axis) * size
    mask = (first + jnp.arange(size))[:, None] >= jnp.arange(size * n)[None, :]
    if seg is not None:
        mask = mask[None] & segment_mask(seg, jax.lax.all_gather(seg, axis, axis=1, tiled=True))
    return _finish(_block(q, k, v, mask, scale), q.dtype)


def _check(q: jax.Array, k: jax.Array, v: jax.Array, strategy: str, n: int, axis: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"expected a context attention strategy in {STRATEGIES}, found {strategy!r}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ShardingError(
            f"expected q (batch, seq, heads, head_dim) and k, v (batch, seq, kv_heads, head_dim) of one batch, "
            f"sequence and head width, found {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ShardingError(f"expected kv_heads dividing heads, found {k.shape[2]} kv heads for {q.shape[2]} heads")
    pieces = 2 * n if strategy == "ring" else n
    if q.shape[1] % pieces:
        raise ShardingError(
            f"context attention ({strategy!r}) over the {axis!r} axis of size {n} cuts the sequence into {pieces} "
            f"equal pieces, but the sequence length is {q.shape[1]}; use a sequence length divisible by {pieces}"
            + (
                " (or strategy 'all_gather', which needs a multiple of the axis size only)"
                if strategy == "ring"
                else ""
            )
        )


def _balanced_ring(
    q: jax.Array, k: jax.Array, v: jax.Array, axis: str, n: int, attend: Attend, seg: jax.Array | None = None
) -> jax.Array:
    """`_ring` on the local contiguous pieces: queries, keys and values moved into the balanced layout together (one
    pair of exchanges; the segment ids by another), the output moved back."""
    widths = (q.shape[2:], k.shape[2:])
    flat = _to_balanced(jnp.concatenate([x.reshape(*x.shape[:2], -1) for x in (q, k, v)], axis=-1), axis, n)
    nq, nk = math.prod(widths[0]), math.prod(widths[1])
    lq, lk, lv = flat[..., :nq], flat[..., nq : nq + nk], flat[..., nq + nk :]
    b, s = flat.shape[:2]
    seg = None if seg is None else _to_balanced(seg, axis, n)
    out = _ring(
        lq.reshape(b, s, *widths[0]), lk.reshape(b, s, *widths[1]), lv.reshape(b, s, *widths[1]), axis, n, attend, seg
    )
    return _from_balanced(out, axis, n)


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    strategy: Strategy = "ring",
    axis: str = SEQUENCE_AXIS,
    scale: float | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    kernel: str = "xla",
    interpret: bool = False,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ``q`` ``(batch, seq, heads, head_dim)`` over ``k``, ``v`` ``(batch, seq, kv_heads,
    head_dim)`` with the sequence split over ``axis`` of ``mesh`` (default: the ambient mesh), by ``strategy``;
    equal to `jax.nn.dot_product_attention` with ``is_causal=True``. ``scale`` defaults to ``head_dim ** -0.5``.
    ``segment_ids`` ``(batch, seq)`` (packed documents, `openhosti_jax.models.segments`): a query sees keys of its
    own segment only; they travel round the ring with the keys (or are gathered with them).

    ``kernel`` computes each device's blocks: ``"xla"`` (einsums, each block recomputed in the backward) or
    ``"splash"`` (`openhosti_jax.models.splash`; ``interpret``: in Pallas's interpreter, off a TPU): the ring's
    blocks by `splash_stats`, the all-gather strategy's local queries over the gathered keys by one
    `gathered_kernel` whose block mask is split with the queries. Batch and heads are split as `over_mesh` says.
    `ShardingError` when the mesh has no such axis, the sequence is not divisible by ``2 x`` its size (``ring``) or
    its size (``all_gather``), or the tensor axis does not divide the heads; `ConfigError` for a kernel that cannot
    take the pieces (`splash_problem`).
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty or axis not in mesh.axis_names:
        raise ShardingError(
            f"context attention needs a mesh with a {axis!r} axis, found "
            f"{'no mesh' if mesh.empty else f'axes {mesh.axis_names}'}; call it under jax.set_mesh(mesh) of such a "
            "mesh (openhosti_jax.build_mesh(MeshConfig(context=...)))"
        )
    n = int(dict(mesh.shape)[axis])
    _check(q, k, v, strategy, n, axis)
    scale = float(q.shape[-1] ** -0.5) if scale is None else float(scale)
    if kernel not in ("xla", "splash"):
        raise ConfigError(f"context attention computes its blocks by kernel 'xla' or 'splash', found {kernel!r}")
    piece = q.shape[1] // (2 * n if strategy == "ring" else n)
    if kernel == "splash" and (problem := splash_problem(piece, q.dtype, q.shape[-1])):
        raise ConfigError(
            f"attention_kernel='splash' under a context axis of {n} ({strategy!r}) runs the kernel on pieces of "
            f"{piece} tokens, which it cannot take: {problem}; use attention_kernel='auto' (XLA's blocks then) or a "
            "sequence length whose pieces are multiples of 128"
        )
    splash = kernel == "splash"
    attend = _splash_block(scale, interpret) if splash else _xla_block(scale)
    extra = None
    if splash and strategy == "all_gather":
        whole = gathered_kernel(q.shape[2] // tensor_ways(mesh, axis), q.shape[1], n, interpret)
        extra = (whole, whole.manual_sharding_spec(NamedSharding(mesh, P(None, axis))))

    def local(q: jax.Array, k: jax.Array, v: jax.Array, *whole: Any, segment_ids: Any = None) -> jax.Array:
        b, s, h_local, d = q.shape
        if whole:
            k, v = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
            seg = None if segment_ids is None else (segment_ids, jax.lax.all_gather(segment_ids, axis, 1, tiled=True))
            return splash_attention(q, k, v, kernel=whole[0], segment_ids=seg)
        grouped = q.reshape(b, s, k.shape[2], h_local // k.shape[2], d)
        if strategy == "all_gather":
            return _gathered(grouped, k, v, axis, n, scale, segment_ids).reshape(b, s, h_local, d)
        return _balanced_ring(grouped, k, v, axis, n, attend, segment_ids).reshape(b, s, h_local, d)

    return over_mesh(local, q, k, v, mesh=mesh, axis=axis, extra=extra, check_vma=not splash, segment_ids=segment_ids)
