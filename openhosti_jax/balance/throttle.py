"""`Throttle`: make chosen data-parallel devices (or every device of chosen processes) really slower.

A throttled device recomputes each microbatch's gradient ``factor - 1`` extra times at a perturbed point and
throws the result away, so its local phase costs ``factor`` times the real work (real FLOPs, not a sleep).
The result never touches the gradient. Used by the tests and benchmarks to emulate thermal throttling or a
competing process; the balanced step takes it as a runtime input, so changing it does not recompile.

Example:
    >>> from openhosti_jax.balance import Throttle
    >>> Throttle.for_devices(4, {3: 2}).factors
    (1, 1, 1, 2)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from openhosti_jax.errors import BalanceError


@dataclass(frozen=True)
class Throttle:
    """Per data-parallel position work multiplier (an integer >= 1; 1 = unthrottled)."""

    factors: tuple[int, ...]
    """``factors[i]``: how many gradient evaluations device ``i`` of the data axis does per microbatch."""

    def __post_init__(self) -> None:
        ok = lambda f: isinstance(f, int) and not isinstance(f, bool) and f >= 1
        bad = [(i, f) for i, f in enumerate(self.factors) if not ok(f)]
        if not self.factors or bad:
            raise BalanceError(
                f"expected Throttle.factors to be a non-empty tuple of ints >= 1, found {self.factors!r} "
                f"(bad entries {bad}); use 1 for an unthrottled device, 2 for twice the work"
            )

    @staticmethod
    def for_devices(size: int, factors: Mapping[int, int]) -> Throttle:
        """Throttle positions ``factors`` keys (0-based along the data axis of ``size`` devices)."""
        out = [1] * size
        for pos, f in factors.items():
            if not 0 <= pos < size:
                raise BalanceError(f"throttled position {pos} is outside the data axis of size {size}")
            out[pos] = f
        return Throttle(tuple(out))

    @staticmethod
    def for_processes(mesh: Mesh, axis: str, factors: Mapping[int, int]) -> Throttle:
        """Throttle every data-axis position whose devices belong to one of the processes in ``factors``."""
        owners = data_axis_processes(mesh, axis)
        unknown = set(factors) - set(owners)
        if unknown:
            raise BalanceError(
                f"processes {sorted(unknown)} own no device of mesh axis {axis!r} (owners: {sorted(set(owners))})"
            )
        return Throttle(tuple(factors.get(p, 1) for p in owners))

    @property
    def extra(self) -> np.ndarray:
        """Extra gradient evaluations per microbatch, one per data position (int32)."""
        return np.asarray(self.factors, np.int32) - 1


def data_axis_processes(mesh: Mesh, axis: str) -> tuple[int, ...]:
    """The process owning each position of ``axis`` (the first device of that slice of the mesh)."""
    if axis not in mesh.axis_names:
        raise BalanceError(f"expected axis {axis!r} in the mesh axes {mesh.axis_names}; pass one of them")
    devs = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    firsts = devs.reshape(devs.shape[0], -1)[:, 0]
    return tuple(int(d.process_index) for d in firsts)
