"""Pack a step's microbatches into per-device buffers of ``capacity`` slots by an assignment of counts.

The global microbatch order is kept: device ``i`` holds microbatches ``offset_i .. offset_i + n_i - 1`` where
``offset_i = n_0 + ... + n_{i-1}``; its unused slots are zeros (never read). The buffer has leading dimension
``D * capacity`` and is sharded over the data axis, so each device sees ``[capacity, ...]``.

Example:
    >>> import numpy as np
    >>> from openhosti_jax.balance import pack_microbatches
    >>> buf = pack_microbatches({"x": np.arange(4.0)[:, None]}, counts=(3, 1), capacity=3)
    >>> buf["x"][:, 0].tolist()
    [0.0, 1.0, 2.0, 3.0, 0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from openhosti_jax.errors import BalanceError

Axes = str | tuple[str, ...]
"""One mesh axis name, or several whose devices together are the balanced (data-parallel) positions."""


def as_axes(axis: Axes) -> tuple[str, ...]:
    """``axis`` as a tuple of mesh axis names."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def axes_size(mesh: Mesh, axis: Axes) -> int:
    """Positions along ``axis`` (the product of the named mesh axes' sizes; 0 if one is missing)."""
    axes = as_axes(axis)
    return int(np.prod([mesh.shape[a] for a in axes])) if all(a in mesh.axis_names for a in axes) else 0


def validate_counts(counts: Sequence[int], size: int, capacity: int, total: int | None = None) -> np.ndarray:
    """``counts`` as int32 after checking length, range ``0..capacity`` and (optionally) the total."""
    arr = np.asarray(counts)
    problems = []
    if arr.shape != (size,):
        problems.append(f"expected {size} counts (one per data-parallel device), found shape {arr.shape}")
    elif not np.issubdtype(arr.dtype, np.integer):
        problems.append(f"expected integer counts, found dtype {arr.dtype}")
    else:
        if (arr < 0).any() or (arr > capacity).any():
            problems.append(f"expected every count in 0..capacity={capacity}, found {arr.tolist()}")
        if arr.sum() < 1:
            problems.append("expected at least one microbatch in the step, found counts summing to 0")
        if total is not None and int(arr.sum()) != total:
            problems.append(f"expected counts summing to the step's {total} microbatches, found {arr.sum()}")
    if problems:
        raise BalanceError("invalid assignment: " + "; ".join(problems) + "; use Rebalancer.assign(...)")
    return arr.astype(np.int32)


def _num_microbatches(microbatches: Any) -> int:
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree_util.tree_leaves(microbatches)}
    if len(sizes) != 1 or None in sizes:
        raise BalanceError(
            f"expected every microbatch leaf to share a leading dimension M (the microbatch index), "
            f"found {sorted(map(str, sizes))}; stack the step's microbatches as [M, microbatch, ...]"
        )
    return sizes.pop()


def slot_sources(counts: Sequence[int], capacity: int) -> np.ndarray:
    """For each of the ``D * capacity`` slots, the global microbatch index it holds, or -1 for padding."""
    src = np.full(len(counts) * capacity, -1, np.int64)
    offset = 0
    for i, n in enumerate(counts):
        src[i * capacity : i * capacity + n] = np.arange(offset, offset + n)
        offset += n
    return src


def pack_microbatches(microbatches: Any, counts: Sequence[int], capacity: int) -> Any:
    """Host (numpy) buffer of leading dim ``len(counts) * capacity`` from microbatches ``[M, ...]``."""
    m = _num_microbatches(microbatches)
    counts = validate_counts(counts, len(counts), capacity, m)
    src = slot_sources(counts, capacity)

    def pack(x):
        x = np.asarray(x)
        out = np.zeros((src.size, *x.shape[1:]), x.dtype)
        out[src >= 0] = x[src[src >= 0]]
        return out

    return jax.tree_util.tree_map(pack, microbatches)


def place_microbatches(microbatches: Any, counts: Sequence[int], capacity: int, mesh: Mesh, axis: Axes = "data") -> Any:
    """Global buffer sharded over ``axis``; each process reads only the slots of its own devices.

    ``microbatches`` (``[M, ...]`` host arrays, the same on every process) is indexed lazily, so a process
    touches only the microbatches assigned to its addressable devices.
    """
    m = _num_microbatches(microbatches)
    size = axes_size(mesh, axis)
    counts = validate_counts(counts, size, capacity, m)
    src = slot_sources(counts, capacity)
    sharding = NamedSharding(mesh, PartitionSpec(axis))

    def place(x):
        shape = (src.size, *np.shape(x)[1:])
        dtype = np.asarray(x[:0]).dtype

        def fill(index):
            rows = src[index[0]]
            block = np.zeros((rows.size, *shape[1:]), dtype)
            if (rows >= 0).any():
                block[rows >= 0] = np.asarray(x[rows[rows >= 0]])
            return block

        return jax.make_array_from_callback(shape, sharding, fill, dtype=dtype)

    return jax.tree_util.tree_map(place, microbatches)
