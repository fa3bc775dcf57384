"""`place_batch`: the one way a batch becomes global sharded ``jax.Array``s over a mesh.

Host data (numpy, lists, torch or tf tensors converted to numpy) is this process's rows: every process passes its
own, and on one process the local batch is the global batch (``jax.make_array_from_process_local_data``). A
``jax.Array`` that is already global is resharded only if its sharding differs. Rank-0 leaves are replicated.
64-bit host arrays are narrowed as JAX would hold them (integers range-checked) when ``jax_enable_x64`` is off.

Example:
    >>> import jax, numpy as np
    >>> from openhosti_jax.sharding.batch import place_batch
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> g = place_batch({"x": np.zeros((16, 3), np.float32), "n": np.float32(2)}, mesh, jax.P("data"))
    >>> g["x"].shape, g["x"].sharding.spec, g["n"].sharding.spec
    ((16, 3), P('data',), P())
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import BatchError
from openhosti_jax.mesh.config import BATCH_AXES, TOKEN_AXES

BatchSpec = P | Mapping[str, P]
"""One PartitionSpec for every leaf, or one per top-level key of a dict batch."""

NARROW = {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}
"""The dtype JAX holds each 64-bit dtype in when ``jax_enable_x64`` is off."""


def check_narrowing(where: str, lo: int, hi: int, dtype: str, error: type[Exception] = BatchError) -> None:
    """Raise ``error`` when integers in ``[lo, hi]`` of 64-bit ``dtype`` do not fit its 32-bit narrowing."""
    info = np.iinfo(np.uint32 if dtype == "uint64" else np.int32)
    if lo < info.min or hi > info.max:
        raise error(
            f"{where}: expected {dtype} values that fit {info.dtype} (jax_enable_x64 is off), found range "
            f"[{lo}, {hi}]; fix: enable 64-bit JAX with jax.config.update('jax_enable_x64', True) or rescale"
        )


def narrow_numpy(x: np.ndarray, where: str) -> np.ndarray:
    """``x`` in the dtype JAX will hold it in: 64-bit types narrowed (ints range-checked) when x64 is off."""
    name = x.dtype.name
    if name not in NARROW or jax.config.jax_enable_x64:
        return x
    if name in ("int64", "uint64") and x.size:
        check_narrowing(where, int(x.min()), int(x.max()), name)
    return x.astype(NARROW[name])


def leaf_spec(spec: P, ndim: int) -> P:
    """``spec``'s first ``ndim`` entries: what a batch spec places of a leaf of rank ``ndim`` (a ``(batch,)`` label
    leaf of a ``(batch, seq)`` token batch split over rows and sequence is split by its rows only)."""
    return P(*tuple(spec)[:ndim])


def default_batch_spec(mesh: Mesh) -> P:
    """The leading dim over the mesh's data-parallel axes (``data``, ``fsdp``) that it has, and ``expert`` where it
    is larger than 1."""
    sizes = dict(mesh.shape)
    axes = tuple(a for a in TOKEN_AXES if a in sizes and (a in BATCH_AXES or sizes[a] > 1))
    return P(axes if axes else None)


def _entry_size(mesh: Mesh, entry: str | tuple[str, ...] | None) -> int:
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[n] for n in names)


def _is_global(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _specs_for(batch: Any, spec: BatchSpec | None, mesh: Mesh) -> Any:
    if not isinstance(spec, Mapping):
        one = default_batch_spec(mesh) if spec is None else spec
        return jax.tree.map(lambda _: one, batch)
    if not isinstance(batch, Mapping):
        raise BatchError(f"a spec per key needs a dict batch, found {type(batch).__name__}; pass one PartitionSpec")
    missing = sorted(set(batch) - set(spec))
    if missing:
        raise BatchError(f"no PartitionSpec for batch keys {missing}; add them to the spec mapping")
    return {k: jax.tree.map(lambda _, s=spec[k]: s, v) for k, v in batch.items()}


def _problems(where: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> list[str]:
    out = []
    for dim, entry in enumerate(spec):
        n = _entry_size(mesh, entry)
        if shape[dim] % n:
            out.append(
                f"{where}: dim {dim} of global size {shape[dim]} is not divisible by the {n} shards of mesh axes "
                f"{entry}; use a global batch that is a multiple of {n} (drop_last=True, or pad and mask)"
            )
    return out


def place_batch(batch: Any, mesh: Mesh, spec: BatchSpec | None = None) -> Any:
    """Every leaf of ``batch`` as a global ``jax.Array`` on ``mesh`` placed by ``spec`` (default: leading dim over
    the data-parallel axes; a leaf takes as many of the spec's entries as it has dims); `BatchError` listing every
    leaf whose global shape the spec does not divide."""
    nproc = jax.process_count()
    specs = _specs_for(batch, spec, mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    leaves = []
    problems = []
    for (path, x), s in zip(flat, treedef.flatten_up_to(specs), strict=True):
        where = f"batch{jax.tree_util.keystr(path)}"
        if not isinstance(x, jax.Array):
            x = narrow_numpy(np.asarray(x), where)
        s = leaf_spec(s, np.ndim(x))
        shape = tuple(np.shape(x))
        if shape and nproc > 1 and not _is_global(x) and s and s[0] is not None:
            shape = (shape[0] * nproc, *shape[1:])  # this process's rows of the global batch
        problems += _problems(where, shape, s, mesh)
        leaves.append((x, NamedSharding(mesh, s)))
    if problems:
        raise BatchError("\n".join(problems))

    def place(x: Any, sharding: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array) and (x.sharding == sharding or nproc == 1 or _is_global(x)):
            return x if x.sharding == sharding else jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.unflatten(treedef, [place(x, s) for x, s in leaves])
