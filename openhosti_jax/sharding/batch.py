"""`place_batch`: the one way a batch becomes global sharded ``jax.Array``s over a mesh; `is_key` and
`batch_leaves`: the one rule for which leaves are batch data.

PRNG keys are never batch data, wherever they sit: a typed key (``jax.random.key``), raw ``uint32`` key data
(``jax.random.PRNGKey``: shape ``(2,)``, or ``(4,)`` for the ``rbg`` implementations) and batches of either
(``jax.random.split(key, n)``) are replicated on every device and never decide the batch size. Of the other leaves,
the batch is those whose leading dimension is the batch size (`batch_size`, `batch_leaves`). One exception keeps a
step traceable: a batch of keys with one key per row (`per_row_keys`: ``split(key, batch)``, mapped over with the
rows) is resized with the rows in the planner's traces and cut with them into microbatches; a single key, or a
batch of keys of another size, is given whole to every microbatch.

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
    >>> g = place_batch({"x": np.zeros((16, 3), np.float32), "rng": jax.random.PRNGKey(0)}, mesh, jax.P("data"))
    >>> g["rng"].sharding.spec  # a key is replicated
    P()
"""

from __future__ import annotations

import math
from collections import Counter
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


RAW_KEY_SIZES = (2, 4)
"""The trailing size of raw ``uint32`` key data: 2 for ``threefry2x32`` (``jax.random.PRNGKey``), 4 for ``rbg``
and ``unsafe_rbg``."""


def is_key(x: Any) -> bool:
    """Whether the leaf ``x`` (an array, a `jax.ShapeDtypeStruct`, a numpy array) is a PRNG key or a batch of
    keys: a typed key dtype, or ``uint32`` data whose last dimension is a raw key's (`RAW_KEY_SIZES`). Keys are
    never batch data; a ``uint32`` data leaf of that shape is read as keys too (hold such data as ``int32``).

    Example:
        >>> import jax, numpy as np
        >>> is_key(jax.random.key(0)), is_key(jax.random.PRNGKey(0)), is_key(jax.random.split(jax.random.key(0), 8))
        (True, True, True)
        >>> is_key(np.zeros((8, 2), np.float32)), is_key(np.zeros((8, 2), np.uint32)), is_key(np.uint32(2))
        (False, True, False)
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    shape = np.shape(x)
    return np.dtype(dtype) == np.uint32 and bool(shape) and shape[-1] in RAW_KEY_SIZES


def key_rows(x: Any) -> int | None:
    """How many keys the key leaf ``x`` holds along its leading dimension (a typed key array's ``shape[0]``, raw
    key data's when it has a dimension before the key's own), None for a single key."""
    typed = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    shape = np.shape(x)
    return shape[0] if len(shape) >= (1 if typed else 2) else None


def per_row_keys(x: Any, rows: int | None) -> bool:
    """Whether ``x`` is a batch of keys with one key per row of a batch of ``rows`` (`key_rows`): replicated like
    every key, but resized and cut into microbatches with the rows so a step mapping over both stays consistent.

    Example:
        >>> import jax
        >>> keys = jax.random.split(jax.random.key(0), 16)
        >>> per_row_keys(keys, 16), per_row_keys(keys, 8), per_row_keys(jax.random.PRNGKey(0), 2)
        (True, False, False)
    """
    return rows is not None and is_key(x) and key_rows(x) == rows


def _splittable(x: Any) -> bool:
    return bool(np.ndim(x)) and not is_key(x)


def batch_size(data: Any) -> int | None:
    """The batch size of ``data``: the most common leading dimension among its leaves of rank >= 1 that are not
    keys (the larger on a tie); None when there is no such leaf.

    Example:
        >>> import jax, numpy as np
        >>> batch_size({"x": np.zeros((16, 3)), "y": np.zeros(16), "rng": jax.random.PRNGKey(0)})
        16
    """
    dims = Counter(np.shape(x)[0] for x in jax.tree.leaves(data) if _splittable(x))
    return max(dims.items(), key=lambda kv: (kv[1], kv[0]))[0] if dims else None


def batch_leaves(data: Any) -> list[bool]:
    """Per leaf of ``data`` (in `jax.tree.leaves` order): whether it is batch data, split over the data axes: a
    leaf that is not a key whose leading dimension is `batch_size`. Every other leaf (scalars, keys, tables) is
    replicated.

    Example:
        >>> import jax, numpy as np
        >>> batch_leaves((np.zeros((16, 3)), jax.random.PRNGKey(0), np.zeros((5, 5)), 3))
        [True, False, False, False]
    """
    size = batch_size(data)
    return [_splittable(x) and np.shape(x)[0] == size for x in jax.tree.leaves(data)]


def check_batch(batch: Any, where: str = "batch") -> int | None:
    """The batch size of a ``(state, batch)`` step's batch, whose every leaf of rank >= 1 that is not a key must
    share one leading dimension; `BatchError` naming each leaf and its leading dimension otherwise. None when no
    leaf has one."""
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    dims = {jax.tree_util.keystr(p): np.shape(x)[0] for p, x in flat if _splittable(x)}
    if len(set(dims.values())) > 1:
        found = ", ".join(f"{where}{k}: {v}" for k, v in dims.items())
        raise BatchError(
            f"expected every batch leaf (PRNG keys aside) to share one leading (batch) dimension, found {found}; "
            "give every batch leaf shape [batch, ...], and pass other arrays (tables, constants) as another "
            "argument of the step, where leaves without the batch dimension are replicated"
        )
    return next(iter(dims.values()), None)


def leaf_spec(spec: P, ndim: int) -> P:
    """``spec``'s first ``ndim`` entries: what a batch spec places of a leaf of rank ``ndim`` (a ``(batch,)`` label
    leaf of a ``(batch, seq)`` token batch split over rows and sequence is split by its rows only)."""
    return P(*tuple(spec)[:ndim])


def batch_leaf_spec(spec: P, x: Any) -> P:
    """What ``spec`` places of the batch leaf ``x``: nothing of a key (replicated, `is_key`), else its first
    ``ndim`` entries (`leaf_spec`)."""
    return P() if is_key(x) else leaf_spec(spec, np.ndim(x))


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
    the data-parallel axes; a leaf takes as many of the spec's entries as it has dims; PRNG keys are replicated,
    `is_key`); `BatchError` listing every leaf whose global shape the spec does not divide."""
    nproc = jax.process_count()
    specs = _specs_for(batch, spec, mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    leaves = []
    problems = []
    for (path, x), s in zip(flat, treedef.flatten_up_to(specs), strict=True):
        where = f"batch{jax.tree_util.keystr(path)}"
        if not isinstance(x, jax.Array):
            x = narrow_numpy(np.asarray(x), where)
        s = batch_leaf_spec(s, x)
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
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed key: its data, re-wrapped
            data = jax.make_array_from_process_local_data(sharding, np.asarray(jax.random.key_data(x)))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.unflatten(treedef, [place(x, s) for x, s in leaves])
