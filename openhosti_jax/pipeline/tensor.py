"""Tensor parallelism inside a pipeline stage: which dim of a parameter is split over ``tensor``, and the one rule a
stage's layers follow so that the collectives XLA inserts for the split cannot deadlock.

The executor runs every stage's layers inside `jax.shard_map` with the ``stage`` and batch axes manual and ``tensor``
left to XLA's partitioner, in `lax.switch` branches that differ from stage to stage. A collective inside a branch
must then involve only devices that take that branch. XLA's all-reduce and all-gather over the ``tensor`` groups do;
the collective-permute its partitioner uses to reshard a value cut at boundaries that are not its shards' (a fused
``[q | k | v]`` projection split into its three parts, each straddling two tensor ranks; a sequence split over
``tensor`` shifted by one token) waits for every device of the mesh, so stages in other branches never join it.
Under `stage_tensor`, the layers' programs (`openhosti_jax.pipeline.split`) gather such a value whole over
``tensor`` along the dims a ``split`` or ``slice`` cuts out of step with the shards (an all-gather within each
tensor group), and the parts stay whole there until XLA splits them again where they are used (a local slice).

Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> tensor_dim(P(None, "tensor")), tensor_dim(P(("fsdp", "tensor"), None)), tensor_dim(P("fsdp"))
    (1, 0, None)
    >>> aligned((64, 64, 64), 2), aligned((64, 64, 64), 3), aligned((32, 32), 4)
    (False, True, True)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from openhosti_jax.sharding.specs import axis_dim

TENSOR = "tensor"
"""The mesh axis a stage's layers are split over."""

_local = threading.local()


def tensor_dim(spec: P) -> int | None:
    """The dim of ``spec`` that names the ``tensor`` mesh axis, or None."""
    return axis_dim(spec, TENSOR)


@contextlib.contextmanager
def stage_tensor(size: int) -> Iterator[None]:
    """Within the block, the pipeline's layers are traced for a ``tensor`` axis of ``size`` left to XLA: their
    programs run nested calls inline and gather a value over ``tensor`` before splitting it at boundaries its
    shards do not share (`unaligned_dims`)."""
    prev = getattr(_local, "size", 1)
    _local.size = size
    try:
        yield
    finally:
        _local.size = prev


def active_size() -> int:
    """The ``tensor`` axis size set by the enclosing `stage_tensor` (1 outside one)."""
    return getattr(_local, "size", 1)


def aligned(sizes: Sequence[int], t: int) -> bool:
    """Whether cutting a dim into parts of ``sizes`` cuts only at the boundaries of its ``t`` equal shards."""
    total = sum(sizes)
    if total % t:
        return True  # XLA cannot split such a dim over the axis: it stays whole
    shard, edge = total // t, 0
    for n in sizes[:-1]:
        edge += n
        if edge % shard:
            return False
    return True


def unaligned_dims(eqn: Any, t: int) -> tuple[int, ...]:
    """The dims a ``split`` or ``slice`` equation cuts at boundaries that are not those of ``t`` equal shards."""
    if eqn.primitive.name == "split":
        return () if aligned([int(n) for n in eqn.params["sizes"]], t) else (eqn.params["axis"],)
    if eqn.primitive.name == "slice":
        shape = eqn.invars[0].aval.shape
        starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
        strides = eqn.params["strides"] or (1,) * len(shape)
        return tuple(
            d
            for d, (n, a, b, k) in enumerate(zip(shape, starts, limits, strides, strict=True))
            if (a, b, k) != (0, n, 1) and not (k == 1 and aligned([a, b - a, n - b], t))
        )
    return ()


def whole_along(x: jax.Array, dims: Sequence[int]) -> jax.Array:
    """``x`` placed whole along ``dims`` (every other dim left to XLA)."""
    return jax.lax.with_sharding_constraint(x, P(*[None if i in dims else P.UNCONSTRAINED for i in range(x.ndim)]))
