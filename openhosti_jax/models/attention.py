"""Causal attention for the bundled models, and over blocks of queries, each block's scores made and freed in turn
and recomputed in the backward pass: the ``seq x seq`` score matrix is never held whole, so activations grow with
the sequence length, not its square (what flash attention achieves with a fused kernel; here plain XLA ops under
`jax.checkpoint`).

`causal_attention` is the models' one entry: the sequence split over a ``context`` mesh axis
(`openhosti_jax.models.context`) where the ambient mesh has one, else a fused kernel where the platform of the mesh
in use has one for the shape (`attention_kernel`: cuDNN's on a GPU, the Pallas splash kernel on a TPU,
`openhosti_jax.models.splash`), else `query_blocks` where a block size is given, else
`jax.nn.dot_product_attention`.

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
from typing import Any

import jax
import jax.numpy as jnp

from openhosti_jax.errors import ConfigError
from openhosti_jax.models.context import Strategy, context_attention, context_size
from openhosti_jax.models.local import over_mesh
from openhosti_jax.models.segments import check_segment_ids, segment_mask
from openhosti_jax.models.splash import BLOCKS, DTYPES, LANES, MAX_HEAD_DIM, splash_attention, splash_problem


def causal_mask(first: jax.Array | int, queries: int, keys: int) -> jax.Array:
    """``(queries, keys)`` booleans: query ``first + i`` sees keys up to its own position."""
    return (first + jnp.arange(queries))[:, None] >= jnp.arange(keys)[None, :]


def query_blocks(attend: Callable[[Any, jax.Array], jax.Array], q: Any, block: int | None) -> jax.Array:
    """``attend(q, 0)`` computed ``block`` queries at a time (``q``: an array, or a pytree of arrays, each batch,
    then sequence), each block under `jax.checkpoint` so that only its inputs are kept for the backward.
    ``attend(q_block, first)`` gets the block (of each leaf) and the position of its first query. ``block`` None
    (or the whole sequence): one call."""
    b, s = jax.tree.leaves(q)[0].shape[:2]
    if block is None or block >= s:
        return attend(q, jnp.asarray(0))
    if s % block:
        raise ConfigError(f"attention_block={block} must divide the sequence length {s}; use a divisor of it")
    n = s // block
    blocks = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(b, n, block, *x.shape[2:]), 1, 0), q)
    step = jax.checkpoint(lambda qb, first: attend(qb, first))
    out = jax.lax.map(lambda a: step(*a), (blocks, jnp.arange(n) * block))
    return jnp.moveaxis(out, 0, 1).reshape(b, s, *out.shape[3:])


KERNELS = ("auto", "xla", "cudnn", "splash")
"""Attention kernels a model may ask for: ``"auto"`` (the fused one the backend has for the shape, else XLA's),
``"xla"``, ``"cudnn"`` (cuDNN's fused flash attention: GPU, half precision), ``"splash"`` (the Pallas splash
kernel, `openhosti_jax.models.splash`: TPU; on CPU it runs in Pallas's interpreter, for tests)."""


def mesh_platform(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None) -> str:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``) of the devices of ``mesh`` (default: the ambient mesh set by
    `jax.set_mesh`), else of JAX's default backend. A CPU process that lowers a step for an abstract TPU topology
    (`jax.experimental.topologies`) has ``"cpu"`` as its default backend and ``"tpu"`` here, so the kernel chosen is
    the one the compiled program runs, whichever process traces it.

    >>> mesh_platform()  # no ambient mesh: the default backend
    'cpu'
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return str(mesh.devices.flat[0].platform)
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return str(device.platform) if device is not None else jax.default_backend()


def attention_kernel(
    kernel: str,
    dtype: jnp.dtype,
    head_dim: int,
    backend: str | None = None,
    seq_len: int | None = None,
    pieces: int = 1,
) -> str:
    """The kernel ``"xla"``, ``"cudnn"`` or ``"splash"`` that attention of ``dtype`` and ``head_dim`` over sequences
    of ``seq_len`` (None: any), each cut into ``pieces`` for a context axis, runs on ``backend`` (default:
    `mesh_platform`) for a request of ``kernel`` (`KERNELS`). ``"auto"`` takes cuDNN's fused attention on a GPU in
    bf16 or fp16 with a head dim it supports (a multiple of 8, at most 128), since jax's own default
    (``implementation=None``) is XLA's on every backend, and the splash kernel on a TPU where it takes the shape
    (`openhosti_jax.models.splash.splash_problem`: bf16 or fp32, sequences or pieces that are multiples of 128, a
    head dim of at most 512); else XLA's (query blocks where the model sets ``attention_block``). A kernel the
    backend or the shape does not allow is a `ConfigError`.

    >>> import jax.numpy as jnp
    >>> attention_kernel("auto", jnp.bfloat16, 128, "gpu"), attention_kernel("auto", jnp.float32, 128, "gpu")
    ('cudnn', 'xla')
    >>> attention_kernel("auto", jnp.bfloat16, 128, "tpu", 8192), attention_kernel("auto", jnp.float16, 128, "tpu")
    ('splash', 'xla')
    >>> attention_kernel("auto", jnp.bfloat16, 128, "cpu")
    'xla'
    """
    if kernel not in KERNELS:
        raise ConfigError(f"attention_kernel={kernel!r}: expected one of {KERNELS}")
    backend = backend or mesh_platform()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    supported = backend == "gpu" and half and head_dim % 8 == 0 and head_dim <= 128
    piece = None if seq_len is None else seq_len // pieces
    problem = splash_problem(piece, dtype, head_dim)
    if problem and pieces > 1:
        problem = f"{problem} in the {pieces} context pieces of the sequence of {seq_len}"
    if kernel == "auto":
        return "cudnn" if supported else "splash" if backend == "tpu" and problem is None else "xla"
    if kernel == "cudnn" and not supported:
        raise ConfigError(
            "attention_kernel='cudnn' needs cuDNN's fused attention: a GPU backend, bf16 or fp16, a head dim that is "
            f"a multiple of 8 up to 128; found backend {backend!r}, {jnp.dtype(dtype).name}, head dim {head_dim}. Use "
            "'auto' (the fused kernel where the backend has one) or 'xla'"
        )
    if kernel == "splash" and (backend not in ("tpu", "cpu") or problem):
        raise ConfigError(
            "attention_kernel='splash' (the Pallas splash attention kernel) runs on a TPU (on CPU in Pallas's "
            f"interpreter) in {' or '.join(DTYPES)}, over sequences that are multiples of {LANES} (its blocks of "
            f"{', '.join(map(str, BLOCKS))} must divide them) with a head dim of at most {MAX_HEAD_DIM}; found "
            + (f"backend {backend!r}" if backend not in ("tpu", "cpu") else problem)
            + ". Use 'auto', which runs XLA's attention (query blocks where attention_block is set) for such a "
            "shape, or 'xla'"
        )
    return kernel


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    block: int | None = None,
    context_strategy: Strategy = "ring",
    kernel: str = "auto",
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention of ``q`` ``(batch, seq, heads, head_dim)`` over ``k``, ``v`` ``(batch, seq,
    kv_heads, head_dim)`` (query head ``h`` reads kv head ``h // (heads // kv_heads)``), scaled by ``head_dim **
    -0.5``; the output is laid out like ``q``. The kernel is `attention_kernel`'s for ``kernel`` on the platform of
    the ambient mesh (`mesh_platform`).

    Under an ambient mesh (`jax.set_mesh`) with a ``context`` axis larger than 1: `context_attention` by
    ``context_strategy``, its blocks by the splash kernel where that is the choice, else XLA's (``block`` unused:
    its pieces are the blocks). Else the splash kernel where that is the choice, inside `over_mesh` (a Pallas
    kernel is not partitioned by XLA). Else where `attention_kernel` picks cuDNN: `jax.nn.dot_product_attention` on
    it, ``block`` unused. Else with ``block``: `query_blocks` of that many queries, scores and softmax in float32.
    Else `jax.nn.dot_product_attention`'s XLA implementation.

    ``segment_ids`` ``(batch, seq)`` (packed documents, `openhosti_jax.models.segments`): a query sees the earlier
    keys of its own segment only, on every path: the context axis's ring and gather (the ids travel with the keys),
    the splash kernel's segment-ids argument, cuDNN's and XLA's attention through their ``mask`` (cuDNN takes it as
    a bias: a ``seq x seq`` tile per sequence), the query blocks' masks.

    >>> import jax, jax.numpy as jnp
    >>> q = jax.random.normal(jax.random.key(0), (1, 8, 4, 2))
    >>> kv = jax.random.normal(jax.random.key(1), (1, 8, 2, 2))
    >>> bool(jnp.allclose(causal_attention(q, kv, kv, block=2), causal_attention(q, kv, kv), atol=1e-6))
    True
    """
    mesh = jax.sharding.get_abstract_mesh()
    backend, n = mesh_platform(mesh), context_size()
    pieces = n if n == 1 or context_strategy == "all_gather" else 2 * n  # the ring's chunks are half a piece
    choice = attention_kernel(kernel, q.dtype, q.shape[-1], backend, q.shape[1], pieces)
    interpret = backend != "tpu"
    seg = check_segment_ids(segment_ids, q.shape[:2])
    if n > 1:
        splash = choice == "splash"
        return context_attention(
            q,
            k,
            v,
            strategy=context_strategy,
            kernel="splash" if splash else "xla",
            interpret=interpret,
            segment_ids=seg,
        )
    if choice == "splash":

        def local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
            ids = None if segment_ids is None else (segment_ids, segment_ids)
            return splash_attention(q, k, v, interpret=interpret, segment_ids=ids)

        if mesh.empty or set(mesh.axis_names) <= set(mesh.manual_axes):
            return local(q, k, v, seg)
        return over_mesh(local, q, k, v, mesh=mesh, check_vma=False, segment_ids=seg)
    mask = None if seg is None else segment_mask(seg, seg)[:, None]
    if choice == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="cudnn")
    if block is None or block >= q.shape[1]:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    b, s, h, d = q.shape
    kvh = k.shape[2]
    grouped = q.reshape(b, s, kvh, h // kvh, d)
    blocked = grouped if seg is None else (grouped, seg)

    def attend(qb: Any, first: jax.Array) -> jax.Array:
        qb, ids = (qb, None) if seg is None else qb
        keep = causal_mask(first, qb.shape[1], s)[None]
        if ids is not None:  # this block's query ids against every key's
            keep = keep & segment_mask(ids, seg)
        att = jnp.einsum("bqngd,bknd->bngqk", qb, k, preferred_element_type=jnp.float32) * d**-0.5
        att = jnp.where(keep[:, None, None], att, jnp.finfo(att.dtype).min)
        return jnp.einsum("bngqk,bknd->bqngd", jax.nn.softmax(att, axis=-1).astype(v.dtype), v)

    return query_blocks(attend, blocked, block).reshape(q.shape)
