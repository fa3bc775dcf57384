"""`to_global_batch`: this process's numpy batch as sharded global ``jax.Array``s over a mesh.

Every process passes its own rows (``jax.make_array_from_process_local_data``); on one process the local batch
is the global batch. The torch and tf.data adapters call this when given a mesh.

Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> g = to_global_batch({"x": np.zeros((16, 3), np.float32)}, mesh, jax.P("data"))
    >>> g["x"].shape, g["x"].sharding.spec
    ((16, 3), P('data',))
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from openhosti_jax.bridges.tensors import narrow_numpy
from openhosti_jax.errors import BatchError
from openhosti_jax.mesh.config import BATCH_AXES

BatchSpec = PartitionSpec | Mapping[str, PartitionSpec]


def default_batch_spec(mesh: Mesh) -> PartitionSpec:
    """The leading dim over the mesh's data-parallel axes (``data``, ``fsdp``) that it has."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    return PartitionSpec(axes if axes else None)


def _axis_count(mesh: Mesh, entry: str | tuple[str, ...] | None) -> int:
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[n] for n in names)


def _problems(key: str, x: np.ndarray, mesh: Mesh, spec: PartitionSpec) -> list[str]:
    if len(spec) > x.ndim:
        return [f"batch[{key!r}]: spec {spec} needs {len(spec)} dims, found shape {x.shape}; give it a batch dim"]
    if jax.process_count() > 1:
        return []  # jax checks the global shape it infers across processes
    out = []
    for dim, entry in enumerate(spec):
        n = _axis_count(mesh, entry)
        if x.shape[dim] % n:
            out.append(
                f"batch[{key!r}]: dim {dim} of size {x.shape[dim]} is not divisible by the {n} shards of mesh "
                f"axes {entry}; use a batch size that is a multiple of {n} (drop_last=True, or pad and mask)"
            )
    return out


def to_global_batch(
    local_batch: Mapping[str, np.ndarray], mesh: Mesh, spec: BatchSpec | None = None
) -> dict[str, jax.Array]:
    """Assemble each process's ``dict[str, np.ndarray]`` rows into global arrays sharded by ``spec``.

    Args:
        local_batch: this process's batch; the global batch is the processes' rows in process order.
        mesh: the device mesh.
        spec: one ``PartitionSpec`` for every key, or one per key; default: leading dim over the mesh's
            ``data``/``fsdp`` axes.

    64-bit arrays are narrowed as JAX would hold them (int64 range-checked) when ``jax_enable_x64`` is off.
    """
    if not isinstance(local_batch, Mapping):
        raise BatchError(f"to_global_batch: expected a dict[str, np.ndarray] batch, found {type(local_batch).__name__}")
    specs = spec if isinstance(spec, Mapping) else dict.fromkeys(local_batch, spec or default_batch_spec(mesh))
    missing = sorted(set(local_batch) - set(specs))
    if missing:
        raise BatchError(f"to_global_batch: no PartitionSpec for keys {missing}; add them to the spec mapping")
    arrays = {k: narrow_numpy(np.asarray(v), f"to_global_batch[{k!r}]") for k, v in local_batch.items()}
    problems = [p for k, x in arrays.items() for p in _problems(k, x, mesh, specs[k])]
    if problems:
        raise BatchError("\n".join(problems))
    out = {}
    for k, x in arrays.items():
        try:
            out[k] = jax.make_array_from_process_local_data(NamedSharding(mesh, specs[k]), x)
        except ValueError as err:
            raise BatchError(f"to_global_batch: batch[{k!r}] of local shape {x.shape}: {err}") from err
    return out


__all__ = ["default_batch_spec", "to_global_batch"]
