"""Per-leaf PartitionSpecs: validation against a mesh, and the automatic rule for unannotated leaves.

The automatic rule: a leaf of at least ``min_elements`` elements is sharded over ``axes`` along its largest dimension
divisible by the product of those axes' sizes; smaller leaves, and leaves with no divisible dimension, are replicated.

Example:
    >>> from openhosti_jax.sharding.specs import auto_spec
    >>> auto_spec((512, 2048), {"fsdp": 8}, ("fsdp",))
    P(None, 'fsdp')
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import ShardingError
from openhosti_jax.sizes import nbytes

DEFAULT_MIN_ELEMENTS = 4096
"""Leaves smaller than this (16 KiB in fp32) are replicated: sharding them costs more latency than it saves."""


def is_spec(x: Any) -> bool:
    """Whether ``x`` is a PartitionSpec (the ``is_leaf`` for trees of specs)."""
    return isinstance(x, P)


def _axes_size(axes: Sequence[str], sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for a in axes)


def auto_spec(
    shape: Sequence[int],
    sizes: Mapping[str, int],
    axes: Sequence[str],
    *,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
    taken: Sequence[str | tuple[str, ...] | None] | None = None,
    frozen: Sequence[int] = (),
) -> P:
    """Shard the largest dimension of ``shape`` divisible by the product of ``axes`` (those of size > 1).

    ``taken`` is an existing spec (e.g. from tensor-parallel rules) whose dims are kept and not reused; ``frozen``
    dims are never sharded (a stacked layer axis, sliced one layer per scan iteration).
    """
    axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
    base: list[Any] = list(taken) + [None] * (len(shape) - len(taken)) if taken else [None] * len(shape)
    if not axes or math.prod(shape) < min_elements:
        return P(*base)
    used = {a for entry in base if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    axes = tuple(a for a in axes if a not in used)
    n = _axes_size(axes, sizes)
    if n == 1:
        return P(*base)
    best = None
    for d in sorted((d for d in range(len(shape)) if d not in frozen), key=lambda d: (-shape[d], d)):
        local = shape[d] // _axes_size(_entry_axes(base[d]), sizes)
        if shape[d] % _axes_size(_entry_axes(base[d]), sizes) == 0 and local % n == 0:
            best = d
            break
    if best is None:
        return P(*base)
    merged = _entry_axes(base[best]) + axes
    base[best] = merged[0] if len(merged) == 1 else merged
    return P(*base)


def _entry_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@functools.lru_cache(maxsize=4096)
def spec_axes(spec: P) -> tuple[str, ...]:
    """Every mesh axis a spec names, in order."""
    return tuple(a for entry in spec for a in _entry_axes(entry))


def axis_dim(spec: P, axis: str) -> int | None:
    """The dim of ``spec`` that names mesh ``axis`` (alone or in a tuple), or None.

    >>> axis_dim(P(None, "tensor"), "tensor"), axis_dim(P(("fsdp", "expert"), None), "expert"), axis_dim(P(), "x")
    (1, 0, None)
    """
    return next((i for i, entry in enumerate(spec) if axis in _entry_axes(entry)), None)


def local_shape(shape: Sequence[int], spec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The per-device block shape of a leaf of ``shape`` placed with ``spec`` (the largest block where a dim does not
    divide evenly)."""
    out = []
    for d, n in enumerate(shape):
        entry = spec[d] if d < len(spec) else None
        out.append(-(-n // _axes_size([a for a in _entry_axes(entry) if a in sizes], sizes)))
    return tuple(out)


def local_bytes(leaf: Any, spec: P, sizes: Mapping[str, int]) -> int:
    """Bytes of one device's block of ``leaf`` (anything with ``shape`` and ``dtype``) placed with ``spec``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> local_bytes(jax.ShapeDtypeStruct((1024, 64), jnp.float32), P("fsdp", None), {"fsdp": 8})
        32768
    """
    return nbytes(local_shape(leaf.shape, spec, sizes), leaf.dtype)


def spec_problems(path: str, shape: Sequence[int], spec: P, sizes: Mapping[str, int]) -> list[str]:
    """Why ``spec`` cannot place a leaf of ``shape`` on a mesh of ``sizes`` (empty when it can)."""
    problems = []
    if len(spec) > len(shape):
        problems.append(f"{path}: spec {spec} has {len(spec)} entries but the leaf has rank {len(shape)}")
        return problems
    seen: set[str] = set()
    for d, entry in enumerate(spec):
        for a in _entry_axes(entry):
            if a not in sizes:
                problems.append(f"{path}: spec {spec} names unknown mesh axis {a!r}; expected one of {tuple(sizes)}")
            elif a in seen:
                problems.append(f"{path}: spec {spec} uses mesh axis {a!r} twice")
            seen.add(a)
        n = _axes_size([a for a in _entry_axes(entry) if a in sizes], sizes)
        if shape[d] % n:
            problems.append(
                f"{path}: dim {d} of shape {tuple(shape)} is {shape[d]}, not divisible by {n} "
                f"(axes {_entry_axes(entry)}); shard another dim or replicate it (None)"
            )
    return problems


def validate_specs(abstract: Any, specs: Any, sizes: Mapping[str, int], what: str = "params") -> None:
    """Raise `ShardingError` listing every leaf whose spec does not fit its shape or the mesh."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    if len(spec_leaves) != len(leaves):
        raise ShardingError(
            f"{what}: expected one PartitionSpec per leaf ({len(leaves)} leaves), found {len(spec_leaves)}; "
            "build specs with jax.tree.map over the same tree"
        )
    problems = []
    for (path, leaf), spec in zip(leaves, spec_leaves, strict=True):
        if not isinstance(spec, P):
            problems.append(f"{what}{jax.tree_util.keystr(path)}: expected a PartitionSpec, found {spec!r}")
            continue
        problems += spec_problems(f"{what}{jax.tree_util.keystr(path)}", leaf.shape, spec, sizes)
    if problems:
        raise ShardingError(f"{len(problems)} sharding problem(s):\n  " + "\n  ".join(problems))
