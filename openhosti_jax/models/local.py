"""Per-device attention over a mesh: `over_mesh` runs a function of one device's queries, keys and values inside
`jax.shard_map`, the batch split over the data-parallel axes, the sequence over a context axis where asked, the heads
over ``tensor`` (used by `openhosti_jax.models.context` and by the Pallas kernels, which XLA does not partition).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.mesh import MeshConfig, build_mesh
    >>> mesh = build_mesh(MeshConfig.from_sizes({"data": 2, "tensor": 2}), jax.devices()[:4])
    >>> q = jax.random.normal(jax.random.key(0), (2, 8, 4, 8))
    >>> kv = jax.random.normal(jax.random.key(1), (2, 8, 2, 8))
    >>> attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> with jax.set_mesh(mesh):
    ...     out = jax.jit(lambda q, k, v: over_mesh(attend, q, k, v, mesh=mesh))(q, kv, kv)
    >>> bool(jnp.allclose(out, attend(q, kv, kv), atol=1e-5))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import ShardingError
from openhosti_jax.mesh.config import TOKEN_AXES

TENSOR_AXIS = "tensor"
"""The axis the heads are split over inside the attention, where the mesh has it."""


def _batch_axes(mesh: jax.sharding.AbstractMesh, rows: int) -> tuple[str, ...]:
    """The data-parallel axes of ``mesh`` the ``rows`` are split over inside the attention (those that divide)."""
    out, ways = [], 1
    for a in TOKEN_AXES:
        size = int(dict(mesh.shape).get(a, 1))
        if a in mesh.axis_names and a not in mesh.manual_axes and size > 1 and rows % (ways * size) == 0:
            out.append(a)
            ways *= size
    return tuple(out)


def tensor_ways(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, axis: str | None) -> int:
    """How many ways `over_mesh` splits the heads: the tensor axis's size where it is free and not ``axis``."""
    free = TENSOR_AXIS in mesh.axis_names and TENSOR_AXIS not in getattr(mesh, "manual_axes", ())
    return int(dict(mesh.shape)[TENSOR_AXIS]) if free and TENSOR_AXIS != axis else 1


def over_mesh(
    local: Callable[..., jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    axis: str | None = None,
    extra: tuple[Any, Any] | None = None,
    check_vma: bool = True,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """``local(q, k, v[, extra][, segment_ids=...])`` on every device of ``mesh`` inside `jax.shard_map`, laid out
    like ``q`` (``segment_ids`` ``(batch, seq)`` split as the tokens are, passed on where given): the batch
    split over the data-parallel axes that divide it, the sequence over ``axis`` (None: whole), the heads over
    ``tensor`` (key/value heads repeated, then sliced, where the tensor axis splits more ways than there are: each
    device's ``k``, ``v`` are then the kv heads its query heads read); other axes replicated. ``extra``: ``(value,
    in_spec)`` of one more argument (a kernel's block masks). ``check_vma=False`` where ``local`` holds a Pallas
    call (its outputs carry no varying-axes type). `ShardingError` when the tensor axis does not divide the heads.
    """
    free = [a for a in mesh.axis_names if a not in getattr(mesh, "manual_axes", ())]
    t, h, kvh = tensor_ways(mesh, axis), q.shape[2], k.shape[2]
    if h % t:
        raise ShardingError(
            f"attention splits the {h} query heads over the {TENSOR_AXIS!r} axis of size {t}, which does not divide "
            f"them; use a tensor axis size dividing {h}"
        )
    rep = t // math.gcd(kvh, t)  # kv heads repeated this often split over the tensor axis with their query heads
    rows = _batch_axes(mesh, q.shape[0])
    heads = TENSOR_AXIS if t > 1 else None
    q_spec, kv_spec = P(rows or None, axis, heads, None), P(rows or None, axis, heads if rep == 1 else None, None)

    def body(q: jax.Array, k: jax.Array, v: jax.Array, *more: Any) -> jax.Array:
        if rep > 1:  # this device's query heads read the kv heads [first, first + width) of the repeated ones
            width = kvh * rep // t
            first = jax.lax.axis_index(TENSOR_AXIS) * width
            k, v = (jax.lax.dynamic_slice_in_dim(jnp.repeat(x, rep, axis=2), first, width, axis=2) for x in (k, v))
        if segment_ids is not None:
            return local(q, k, v, *more[:-1], segment_ids=more[-1])
        return local(q, k, v, *more)

    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = any(types[a] == AxisType.Explicit for a in free)
    args, specs = [q, k, v], [q_spec, kv_spec, kv_spec]
    if extra is not None:
        args.append(extra[0])
        specs.append(extra[1])
    if segment_ids is not None:
        args.append(segment_ids)
        specs.append(P(rows or None, axis))
    if explicit:  # shard_map then wants its inputs placed as specified; the output goes back to q's placement
        placed = jax.typeof(q).sharding.spec
        args = jax.tree.map(lambda x, s: jax.reshard(x, NamedSharding(mesh, s)), args, specs)
    out = jax.shard_map(
        body, mesh=mesh, in_specs=tuple(specs), out_specs=q_spec, axis_names=set(free), check_vma=check_vma
    )(*args)
    return jax.reshard(out, NamedSharding(mesh, placed)) if explicit else out


__all__ = ["TENSOR_AXIS", "over_mesh", "tensor_ways"]
