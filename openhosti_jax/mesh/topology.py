"""TPU slices that are not attached, as compile targets: a slice name (``"v5p-128"``, ``"v6e-256"``, multislice
``"2xv5p-256"``) parsed into a `TpuTarget`, its abstract devices from libtpu (no TPU needed: XLA:TPU compiles ahead
of time on any machine, as MaxText's ``train_compile.py`` does), and a `jax.sharding.Mesh` over them.

A slice name counts what Google Cloud counts: TensorCores for v4 and v5p (two per chip), chips for v5e and v6e.
The slice's shape is the one Cloud gives that many chips (a 3D torus for v4 and v5p: ``4x4x4`` for 64 chips; a 2D
one for v5e and v6e: ``16x16`` for 256), or one named outright (``"v5p:4x4x8"``).

Example:
    >>> t = tpu_target("v5p-128")
    >>> t.name, t.chips, t.topology_name, t.profile_name
    ('v5p-128', 64, 'v5p:4x4x4', 'TPU v5p')
    >>> t = tpu_target("2xv6e-256")
    >>> t.slices, t.devices_per_slice, t.topology_name
    (2, 256, 'v6e:16x16')
    >>> tpu_target("v5p:4x4x8").name
    'v5p-256'
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from openhosti_jax.errors import MeshConfigError, MissingExtraError

GENERATIONS: dict[str, tuple[int, int, str]] = {
    # generation -> (TensorCores per chip as a slice name counts them, torus dims, the planner's device profile)
    "v4": (2, 3, "TPU v4"),
    "v5p": (2, 3, "TPU v5p"),
    "v5e": (1, 2, "TPU v5e"),
    "v6e": (1, 2, "TPU v6e"),
}
"""The TPU generations a target may name."""

TPU_EXTRA = 'pip install "openhosti_jax[tpu]"'
"""How to install what compiling for a TPU target needs (libtpu, through ``jax[tpu]``)."""

_HOST = (2, 2, 1)
"""Chips per host along each torus dim (four chips per host; the host split does not change a compiled program)."""


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """One or more identical TPU slices joined by DCN, to compile for."""

    generation: str
    """``"v4"``, ``"v5p"``, ``"v5e"`` or ``"v6e"``."""
    shape: tuple[int, ...]
    """Chips along each torus dim of one slice."""
    slices: int = 1
    """Slices joined by the data-center network (multislice)."""

    def __post_init__(self) -> None:
        if self.generation not in GENERATIONS:
            raise MeshConfigError(f"unknown TPU generation {self.generation!r}; expected one of {sorted(GENERATIONS)}")
        dims = GENERATIONS[self.generation][1]
        if len(self.shape) != dims or any(int(d) < 1 for d in self.shape) or self.slices < 1:
            raise MeshConfigError(
                f"a {self.generation} slice is a {dims}D torus of chips and at least one slice; found shape "
                f"{self.shape} and {self.slices} slice(s): name it like {_example(self.generation)}"
            )
        bad = [d for d, h in zip(self.shape, _HOST, strict=False) if d % h]
        if bad:
            raise MeshConfigError(
                f"a {self.generation} slice of shape {'x'.join(map(str, self.shape))} does not divide into hosts of "
                f"{'x'.join(map(str, _HOST[:dims]))} chips; use at least 4 chips per slice, e.g. "
                f"{_example(self.generation)}"
            )

    @property
    def chips(self) -> int:
        """Chips per slice."""
        return math.prod(self.shape)

    @property
    def devices_per_slice(self) -> int:
        """Devices JAX sees per slice (one per chip: v4 and v5p run their two TensorCores as one, megacore)."""
        return self.chips

    @property
    def n_devices(self) -> int:
        """Devices in all slices."""
        return self.chips * self.slices

    @property
    def name(self) -> str:
        """The slice name, as Google Cloud writes it (``"v5p-128"``; ``"2xv5p-128"`` for two slices)."""
        base = f"{self.generation}-{self.chips * GENERATIONS[self.generation][0]}"
        return base if self.slices == 1 else f"{self.slices}x{base}"

    @property
    def topology_name(self) -> str:
        """What libtpu calls one slice's topology (``"v5p:4x4x4"``)."""
        return f"{self.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def chip_config_name(self) -> str:
        """``"megacore"`` (v4, v5p: one device per chip) or ``"default"``."""
        return "megacore" if GENERATIONS[self.generation][0] == 2 else "default"

    @property
    def profile_name(self) -> str:
        """The planner's device profile for its chips (`openhosti_jax.planner.profiles.PROFILES`)."""
        return GENERATIONS[self.generation][2]

    def devices(self) -> list[Any]:
        """The target's abstract devices (`jax.experimental.topologies.get_topology_desc`): they compile, they do
        not run. Raises `MissingExtraError` naming the extra where libtpu is not installed."""
        return list(_topology(self.topology_name, self.chip_config_name, self.slices))


def _example(generation: str) -> str:
    cores = GENERATIONS[generation][0]
    return f"'{generation}-{64 * cores}' or '{generation}:{'4x4x4' if GENERATIONS[generation][1] == 3 else '8x8'}'"


def torus_shape(generation: str, chips: int) -> tuple[int, ...]:
    """The torus Google Cloud gives ``chips`` chips of ``generation``: from the host's ``2x2(x1)`` the shortest dim
    doubled in turn (the last of equal ones), listed shortest first (``4x4x8`` for 128 v5p chips, ``8x16`` for 128 v6e).

    >>> torus_shape("v5p", 64), torus_shape("v5p", 1024), torus_shape("v6e", 256), torus_shape("v5p", 4)
    ((4, 4, 4), (8, 8, 16), (16, 16), (2, 2, 1))
    """
    dims = GENERATIONS[generation][1]
    if chips < 4 or chips & (chips - 1):
        raise MeshConfigError(
            f"a {generation} slice of {chips} chips has no standard shape: expected a power of two of at least 4 "
            f"chips ({', '.join(f'{generation}-{n * GENERATIONS[generation][0]}' for n in (4, 8, 16, 64, 256))}, "
            f"...), or name the torus outright ({_example(generation)})"
        )
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:  # the shortest dim doubles, the last of equals first
        shape[min(range(dims), key=lambda j: (shape[j], -j))] *= 2
    return (*sorted(d for d in shape if d > 1), *(d for d in shape if d == 1))


def tpu_target(spec: str | TpuTarget) -> TpuTarget:
    """A `TpuTarget` from a slice name: ``"v5p-128"`` (TensorCores for v4 / v5p, chips for v5e / v6e), several
    slices ``"2xv5p-256"``, or a torus ``"v5p:4x4x8"`` (``"2xv5p:4x4x8"``). Raises `MeshConfigError` naming the
    forms for anything else."""
    if isinstance(spec, TpuTarget):
        return spec
    text = spec.strip().lower() if isinstance(spec, str) else ""
    named = re.fullmatch(r"(?:(\d+)x)?(v4|v5p|v5e|v6e)-(\d+)", text)
    torus = re.fullmatch(r"(?:(\d+)x)?(v4|v5p|v5e|v6e):(\d+(?:x\d+)*)", text)
    if named:
        slices, gen, count = int(named[1] or 1), named[2], int(named[3])
        cores = GENERATIONS[gen][0]
        if count % cores:
            raise MeshConfigError(
                f"{spec!r}: a {gen} slice name counts TensorCores, {cores} per chip; found {count}, not a multiple "
                f"of {cores}: e.g. {_example(gen)}"
            )
        return TpuTarget(gen, torus_shape(gen, count // cores), slices)
    if torus:
        return TpuTarget(torus[2], tuple(int(d) for d in torus[3].split("x")), int(torus[1] or 1))
    raise MeshConfigError(
        f"unknown TPU target {spec!r}: expected a slice name 'GEN-N' (e.g. 'v5p-128', 'v6e-256'), several slices "
        f"'KxGEN-N' (e.g. '2xv5p-256') or a torus 'GEN:AxBxC' (e.g. 'v5p:4x4x4'), GEN one of {sorted(GENERATIONS)}"
    )


def is_tpu_target(spec: Any) -> bool:
    """Whether ``spec`` names a TPU target (`tpu_target` would parse it)."""
    if isinstance(spec, TpuTarget):
        return True
    try:
        tpu_target(spec)
    except MeshConfigError as e:
        return "unknown TPU target" not in str(e)
    return True


def libtpu_available() -> bool:
    """Whether libtpu (what compiles for a TPU target) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def _topology(name: str, chip_config: str, slices: int) -> Sequence[Any]:
    if not libtpu_available():
        raise MissingExtraError(
            f"compiling for the TPU target {name!r} needs libtpu, which is not installed; {TPU_EXTRA} (it adds "
            "jax[tpu], about 700 MB), or plan without compiling (the prediction alone)"
        )
    from jax.experimental import topologies

    # a compile-only process shares libtpu with others on this machine (no TPU is opened)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    bounds = _HOST if len(name.split(":")[1].split("x")) == 3 else (2, 2, 1)
    try:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=name,
            chip_config_name=chip_config,
            chips_per_host_bounds=bounds,
            num_slices=slices,
        )
    except Exception as e:  # libtpu's own words: an unsupported shape or slice count
        raise MeshConfigError(f"libtpu cannot describe the TPU target {name!r} x {slices} slice(s): {e}") from e
    return desc.devices


def target_mesh(target: TpuTarget | str, sizes: Mapping[str, int], axes: Sequence[str]) -> Mesh:
    """A mesh with ``axes`` of ``sizes`` over ``target``'s devices: within a slice laid out on the torus by
    `jax.experimental.mesh_utils.create_device_mesh` (the axes' neighbours on ICI links); over several slices the
    outermost axes that the slice count divides span them (`create_hybrid_device_mesh`: only those cross DCN).
    Raises `MeshConfigError` where the sizes do not multiply to the device count or cannot span the slices."""
    from jax.experimental import mesh_utils

    t = tpu_target(target)
    shape = tuple(int(sizes.get(a, 1)) for a in axes)
    if math.prod(shape) != t.n_devices:
        raise MeshConfigError(
            f"a mesh of {dict(zip(axes, shape, strict=True))} spans {math.prod(shape)} devices, but the target "
            f"{t.name} has {t.n_devices} ({t.slices} slice(s) of {t.chips} chips); give axis sizes whose product is "
            f"{t.n_devices}"
        )
    devices = t.devices()
    if t.slices == 1:
        try:
            arr = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            arr = np.asarray(devices, dtype=object).reshape(shape)
        return Mesh(arr, tuple(axes))
    dcn, left = [1] * len(shape), t.slices
    for i, n in enumerate(shape):  # the outermost axes take the slices
        f = math.gcd(n, left)
        dcn[i], left = f, left // f
    if left != 1:
        raise MeshConfigError(
            f"the mesh {dict(zip(axes, shape, strict=True))} cannot span {t.slices} slices: no outer axes multiply "
            f"to a multiple of {t.slices}; give a data or fsdp axis that the slice count divides"
        )
    ici = tuple(n // d for n, d in zip(shape, dcn, strict=True))
    arr = mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn), devices=devices, allow_split_physical_axes=True)
    return Mesh(arr, tuple(axes))
