"""The Pallas splash attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) for the models' causal
grouped-query attention on TPU: each score block stays in the chip's vector memory and the blocks above the causal
diagonal are skipped, in the forward and both backward kernels (dq, and dk with dv), so no ``seq x seq`` tensor and
no query block's score tile is ever in HBM.

A Pallas kernel is not partitioned by XLA: under a mesh the caller runs these functions inside `jax.shard_map`
(`openhosti_jax.models.context.over_mesh`), each device on its own batch rows and heads. They take one device's
arrays:

- `splash_attention`: causal attention of ``q`` ``(batch, seq, heads, head_dim)`` over ``k``, ``v`` ``(batch, seq,
  kv_heads, head_dim)`` (query head ``h`` reads kv head ``h // (heads // kv_heads)``, as the kernel's own grouping).
- `splash_stats`: one block of the context axis's ring, as an online-softmax partial result ``(lse, 1, out)``. The
  kernel's own VJP cannot differentiate its log-sum-exp (``save_residuals=True`` is forward-only), so this block
  has its own: the gradient of ``lse`` adds ``dlse * p`` to the scores' gradient, which is the kernel's backward
  with its row term ``di = rowsum(out * dout)`` lowered by ``dlse``; the kernel's dq and dkv passes are called with
  that ``di`` (`_block_grads`, the one place that reaches into the kernel module's private functions; jax is
  pinned below 0.11 in pyproject.toml).
- `gathered_kernel`: the all-gather strategy's kernel, over the whole sequence's keys with the queries split over
  the context axis (its block mask is split with them: `SplashAttentionKernel.manual_sharding_spec`).

The kernel's limits (`splash_problem`): bf16 or fp32 (fp16 does not compile for TPU: Mosaic rejects its loads),
a sequence (each piece, under a context axis) that is a multiple of 128 (its blocks of 512, 256 or 128 must divide
it: `block_size`), a head dim of at most 512 (AOT-compiled for v5p from 8 to 512; below 128 the kernel pads to the
128 lanes). Off a TPU the kernel runs in Pallas's interpreter (``interpret=True``): the same blocks and masks as XLA
ops, slow, for tests.

Example:
    >>> import jax, jax.numpy as jnp
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 4, 64))
    >>> kv = jax.random.normal(jax.random.key(1), (1, 256, 2, 64))
    >>> out = splash_attention(q, kv, kv, interpret=True)
    >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, kv, kv, is_causal=True), atol=1e-5))
    True
    >>> splash_problem(200, jnp.float16, 128)
    'dtype float16 (it takes bfloat16, float32); sequence length 200 (a multiple of 128)'
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _sm

from openhosti_jax.errors import ConfigError

DTYPES: tuple[str, ...] = ("bfloat16", "float32")
"""The dtypes the kernel takes."""

LANES = 128
"""The TPU's lane width: the kernel's sequence blocks are multiples of it."""

BLOCKS: tuple[int, ...] = (512, 256, 128)
"""Sequence block sizes tried, largest first (MaxText's v5p default is 512)."""

MAX_HEAD_DIM = 512
"""The widest head checked to compile."""

Stats = tuple[jax.Array, jax.Array, jax.Array]
"""An online-softmax partial result, as `openhosti_jax.models.context.Stats`."""

Segments = tuple[jax.Array, jax.Array]
"""``(query segment ids (batch, q), key segment ids (batch, k))``, int32 (`openhosti_jax.models.segments`)."""


def splash_problem(seq_len: int | None, dtype: Any, head_dim: int) -> str | None:
    """Why the kernel cannot take attention of ``dtype`` and ``head_dim`` over sequences (or, under a context
    axis, pieces) of ``seq_len`` (None: not checked); None when it can."""
    problems = []
    if jnp.dtype(dtype).name not in DTYPES:
        problems.append(f"dtype {jnp.dtype(dtype).name} (it takes {', '.join(DTYPES)})")
    if seq_len is not None and seq_len % LANES:
        problems.append(f"sequence length {seq_len} (a multiple of {LANES})")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        problems.append(f"head dim {head_dim} (at most {MAX_HEAD_DIM})")
    return "; ".join(problems) or None


def block_size(seq_len: int) -> int:
    """The largest of `BLOCKS` dividing ``seq_len`` (`ConfigError` when none does).

    >>> block_size(8192), block_size(384), block_size(640)
    (512, 128, 128)
    """
    for b in BLOCKS:
        if seq_len % b == 0:
            return b
    raise ConfigError(
        f"the splash attention kernel needs a sequence length that is a multiple of {LANES}, found {seq_len}; "
        "pad the sequence or use attention_kernel='auto' (XLA's attention for such a length) or 'xla'"
    )


def causal_block_fraction(seq_len: int) -> float:
    """The fraction of the ``(query block, key block)`` pairs of a sequence of ``seq_len`` that the causal kernel
    computes, read from its block mask: the blocks on and below the diagonal, ``(n + 1) / 2n`` of ``n x n``.

    >>> causal_block_fraction(8192)  # 16 x 16 blocks of 512
    0.53125
    """
    mask = np.asarray(_kernel(1, seq_len, seq_len, True, 1, True, False).fwd_mask_info.block_mask)
    return float(np.count_nonzero(mask) / mask.size)


def _kernel(
    heads: int, q_len: int, kv_len: int, causal: bool, q_shards: int, interpret: bool, residuals: bool
) -> _sk.SplashAttentionKernel:
    """The kernel for ``heads`` query heads of ``q_len`` queries (over ``q_shards`` devices) and ``kv_len`` keys;
    ``causal``: query ``i`` sees keys ``0..i``, else all; ``residuals``: it returns ``(out, (lse,))``. Made anew in
    each trace (its block masks are that trace's constants; the kernel module caches their numpy form)."""
    bq, bkv = block_size(q_len // q_shards), block_size(kv_len)
    sizes = _sk.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    mask = _sm.CausalMask((q_len, kv_len)) if causal else _sm.FullMask((q_len, kv_len))
    return _sk.make_splash_mha(
        _sm.MultiHeadMask([mask] * heads),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=q_shards,
        save_residuals=residuals,
        interpret=interpret,
    )


def _heads_major(x: jax.Array) -> jax.Array:
    """``(batch, seq, heads, d)`` -> ``(batch, heads, seq, d)``, the kernel's layout."""
    return jnp.swapaxes(x, 1, 2)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    interpret: bool = False,
    kernel: _sk.SplashAttentionKernel | None = None,
    segment_ids: Segments | None = None,
) -> jax.Array:
    """Causal attention of one device's ``q`` ``(batch, seq, heads, head_dim)`` over ``k``, ``v`` ``(batch, seq,
    kv_heads, head_dim)``, scaled by ``head_dim ** -0.5``, laid out like ``q``; ``interpret``: in Pallas's
    interpreter (off a TPU). ``kernel``: a `gathered_kernel`'s local part, for this device's piece of the queries
    over the whole sequence's keys (default: the causal kernel of queries and keys of one sequence).
    ``segment_ids``: ``(query ids (batch, q), key ids (batch, k))``: a query sees keys of its own segment only (the
    kernel's own segment-ids argument)."""
    _check(q, k, v)
    if kernel is None:
        kernel = _kernel(q.shape[2], q.shape[1], k.shape[1], True, 1, interpret, False)
    args = (_heads_major(q * q.shape[-1] ** -0.5), _heads_major(k), _heads_major(v))
    if segment_ids is None:
        return _heads_major(jax.vmap(kernel)(*args))
    out = jax.vmap(lambda q, k, v, sq, sk: kernel(q, k, v, segment_ids=_sk.SegmentIds(q=sq, kv=sk)))(
        *args, *segment_ids
    )
    return _heads_major(out)


def gathered_kernel(heads: int, seq_len: int, shards: int, interpret: bool) -> _sk.SplashAttentionKernel:
    """The causal kernel over a whole sequence of ``seq_len`` for ``heads`` query heads whose queries are split into
    ``shards`` contiguous pieces, one per device: pass it into `jax.shard_map` with
    ``kernel.manual_sharding_spec(NamedSharding(mesh, P(None, axis)))`` and call it inside on the local queries
    ``(heads, seq_len // shards, d)`` and the gathered keys and values ``(kv_heads, seq_len, d)``."""
    return _kernel(heads, seq_len, seq_len, True, shards, interpret, False)


def _check(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    problem = splash_problem(q.shape[1], q.dtype, q.shape[-1]) or splash_problem(k.shape[1], k.dtype, k.shape[-1])
    if problem or k.shape != v.shape or q.shape[2] % k.shape[2] or q.dtype != k.dtype or k.dtype != v.dtype:
        raise ConfigError(
            "the splash attention kernel takes q (batch, seq, heads, head_dim) and k, v (batch, seq, kv_heads, "
            f"head_dim) of one dtype, kv_heads dividing heads; found {q.shape} {q.dtype}, {k.shape} {k.dtype}, "
            f"{v.shape} {v.dtype}" + (f": it cannot take {problem}" if problem else "")
        )


def splash_stats(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool,
    scale: float,
    interpret: bool = False,
    segment_ids: Segments | None = None,
) -> Stats:
    """The online-softmax partial result ``(lse, ones, out)`` (each ``(b, q, n, g[, d])``, float32) of grouped
    queries ``q`` ``(b, q, n, g, d)`` over keys and values ``(b, k, n, d)``: all of them, or (``causal``) query
    ``i`` over keys ``0..i`` of a block on the diagonal, and (``segment_ids``) only keys of the query's segment;
    differentiable in ``q``, ``k``, ``v`` through ``lse`` and ``out`` both. A query row that sees no key gets the
    kernel's mask value as its ``lse`` (about -2.4e38), which weighs nothing in a merge with a row that sees one."""
    b, c, n, g, d = q.shape
    qh = (q * scale).transpose(0, 2, 3, 1, 4).reshape(b, n * g, c, d)
    out, lse = _block(qh, _heads_major(k), _heads_major(v), segment_ids, causal, interpret)
    lse = lse.reshape(b, n, g, c).transpose(0, 3, 1, 2)
    out = out.reshape(b, n, g, c, d).transpose(0, 3, 1, 2, 4).astype(jnp.float32)
    return lse, jnp.ones_like(lse), out


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _block(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Segments | None, causal: bool, interpret: bool
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of ``q`` ``(b, heads, c, d)`` (already scaled) over ``k``, ``v`` ``(b, kv_heads, c, d)``."""
    return _block_fwd(q, k, v, segment_ids, causal, interpret)[0]


def _ids(segment_ids: Segments | None) -> tuple[Any, Any]:
    """The query and key segment ids to vmap over (``None`` each where there are none)."""
    return segment_ids if segment_ids is not None else (None, None)


def _block_fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Segments | None, causal: bool, interpret: bool
) -> tuple[Any, Any]:
    kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], causal, 1, interpret, True)
    sq, sk = _ids(segment_ids)

    def one(q: jax.Array, k: jax.Array, v: jax.Array, sq: Any, sk: Any) -> Any:
        return kernel(q, k, v, segment_ids=None if sq is None else _sk.SegmentIds(q=sq, kv=sk))

    out, (lse,) = jax.vmap(one)(q, k, v, sq, sk)
    return (out, lse), (q, k, v, segment_ids, out, lse)


def _block_bwd(causal: bool, interpret: bool, res: tuple, cts: tuple) -> tuple[Any, ...]:
    q, k, v, segment_ids, out, lse = res
    dout, dlse = cts
    dout = dout.astype(q.dtype)
    di = jnp.einsum("bhsd,bhsd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32)) - dlse
    kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], causal, 1, interpret, True)
    sq, sk = _ids(segment_ids)
    grads = jax.vmap(functools.partial(_block_grads, kernel))(q, k, v, lse, dout, di, sq, sk)
    return (*grads, None)


_block.defvjp(_block_fwd, _block_bwd)


def _collapsed(info: Any) -> Any:
    """A mask info with its partial mask blocks flattened to ``(n, bq, bkv)``, as the kernel's own call does."""
    if info is None or info.partial_mask_blocks is None:
        return info
    return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(-1, *info.partial_mask_blocks.shape[-2:]))


def _block_grads(
    kernel: _sk.SplashAttentionKernel, q: jax.Array, k: jax.Array, v: jax.Array, lse: jax.Array, do: jax.Array,
    di: jax.Array, sq: jax.Array | None = None, sk: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """dq, dk, dv of one example's block by the kernel's dkv and dq passes with the row term ``di`` given (and the
    segment ids ``sq``, ``sk`` where there are some)."""
    ids = None if sq is None else _sk.SegmentIds(q=sq, kv=sk)
    kw, sizes = kernel.kwargs, kernel.kwargs["block_sizes"]
    common = {
        "is_mqa": False,
        "mask_value": kw["mask_value"],
        "attn_logits_soft_cap": kw["attn_logits_soft_cap"],
        "q_layout": sizes.q_layout,
        "k_layout": sizes.k_layout,
        "v_layout": sizes.v_layout,
        "mask_function": kw["mask_function"],
        "interpret": kw["interpret"],
    }
    _, dk, dv = _sk._splash_attention_bwd_dkv(  # private: see the module docstring
        q, k, v, ids, None, lse, do, di,
        bq=sizes.block_q_dkv,
        bkv=sizes.block_kv_dkv,
        bkv_compute=sizes.block_kv_dkv_compute,
        mask_info=_collapsed(kernel.dkv_mask_info),
        use_fused_bwd_kernel=False,
        **common,
    )  # fmt: skip
    dq = _sk._splash_attention_bwd_dq(
        q, k, v, ids, None, lse, do, di,
        bq=sizes.block_q_dq,
        bkv=sizes.block_kv_dq,
        mask_info=_collapsed(kernel.dq_mask_info),
        **common,
    )  # fmt: skip
    return dq, dk, dv
