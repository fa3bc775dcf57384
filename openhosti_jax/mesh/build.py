"""Build a `jax.sharding.Mesh` with the library's named axes from a `MeshConfig`.

Example:
    >>> import jax
    >>> from openhosti_jax.mesh import MeshConfig, build_mesh
    >>> mesh = build_mesh(MeshConfig(data=-1))
    >>> mesh.axis_names
    ('stage', 'data', 'fsdp', 'expert', 'context', 'tensor')
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from openhosti_jax.errors import MeshConfigError
from openhosti_jax.mesh.config import AXES, MeshConfig


def _axis_types(config: MeshConfig) -> tuple[AxisType, ...]:
    kind = AxisType.Auto if config.axis_type == "auto" else AxisType.Explicit
    return (kind,) * len(AXES)


def build_mesh(config: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all) with axes `openhosti_jax.mesh.AXES`
    (``("stage", "data", "fsdp", "expert", "context", "tensor")``).

    With ``config.dcn`` set (multi-slice or multi-host), devices are laid out by
    `mesh_utils.create_hybrid_device_mesh` so that the DCN factor of each axis spans slices/processes and the rest
    stays inside one (fast links innermost).
    """
    config = config or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    if not devices:
        raise MeshConfigError("expected at least one device, found none")
    sizes = config.resolve(len(devices))
    shape = tuple(sizes[a] for a in AXES)
    if config.dcn:
        dcn = tuple(config.dcn.get(a, 1) for a in AXES)
        ici = tuple(s // d for s, d in zip(shape, dcn, strict=True))
        granules = {getattr(d, "slice_index", None) for d in devices}
        process_is_granule = None in granules or len(granules) == 1
        n_granules = len({d.process_index for d in devices}) if process_is_granule else len(granules)
        if int(np.prod(dcn)) != n_granules:
            raise MeshConfigError(
                f"dcn factors {config.dcn} multiply to {int(np.prod(dcn))} but the devices span {n_granules} "
                f"{'processes' if process_is_granule else 'slices'}; make the dcn product equal that count"
            )
        arr = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices=devices, process_is_granule=process_is_granule, allow_split_physical_axes=True
        )
    elif len(devices) == len(jax.devices()) and devices == jax.devices():
        try:
            arr = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            arr = np.asarray(devices, dtype=object).reshape(shape)
    else:
        arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, AXES, axis_types=_axis_types(config))


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """Axis name -> size of a mesh, in axis order."""
    return dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
