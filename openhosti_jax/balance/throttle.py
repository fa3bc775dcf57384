"""`Throttle`: make chosen data-parallel devices (or every device of chosen processes) really slower.

Two kinds of slowness, for tests and benchmarks (the balanced step takes either as a runtime input, so changing
the factors does not recompile; neither ever touches the gradient):

* work (default): a throttled device recomputes each microbatch's gradient ``factor - 1`` extra times at a
  perturbed point and throws the result away: ``factor`` times the real FLOPs. Like a competing process, it
  takes core time from every device that shares the cores (all simulated CPU devices do).
* stall (``microbatch_seconds`` given): after each microbatch a throttled device blocks for
  ``(factor - 1) * microbatch_seconds`` in a host callback, leaving the cores to the others. Like a throttled
  accelerator: it is slower by ``factor`` without slowing its peers.

Example:
    >>> from openhosti_jax.balance import Throttle
    >>> Throttle.for_devices(4, {3: 2}).factors
    (1, 1, 1, 2)
    >>> Throttle.for_devices(4, {3: 2}, microbatch_seconds=0.01).stall_seconds.tolist()
    [0.0, 0.0, 0.0, 0.009999999776482582]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from openhosti_jax.balance.buffer import Axes, as_axes, axes_size
from openhosti_jax.errors import BalanceError


@dataclass(frozen=True)
class Throttle:
    """Per data-parallel position work multiplier (an integer >= 1; 1 = unthrottled)."""

    factors: tuple[int, ...]
    """``factors[i]``: how many microbatches' worth of time device ``i`` of the data axis takes per microbatch."""
    microbatch_seconds: float | None = None
    """None: the extra time is real work. A float: the unthrottled seconds of one microbatch; the extra time is
    a stall of ``(factor - 1)`` times it (measure it on the real step, e.g. with `BalancedGradFn.probe`)."""

    def __post_init__(self) -> None:
        ok = lambda f: isinstance(f, int) and not isinstance(f, bool) and f >= 1
        bad = [(i, f) for i, f in enumerate(self.factors) if not ok(f)]
        if not self.factors or bad:
            raise BalanceError(
                f"expected Throttle.factors to be a non-empty tuple of ints >= 1, found {self.factors!r} "
                f"(bad entries {bad}); use 1 for an unthrottled device, 2 for twice the work"
            )
        mb = self.microbatch_seconds
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int | float) or not 0 < mb < 3600):
            raise BalanceError(
                f"expected Throttle.microbatch_seconds to be None (real extra work) or seconds in (0, 3600), "
                f"found {mb!r}; measure one unthrottled microbatch and pass its time"
            )

    @staticmethod
    def for_devices(size: int, factors: Mapping[int, int], microbatch_seconds: float | None = None) -> Throttle:
        """Throttle positions ``factors`` keys (0-based along the data axis of ``size`` devices)."""
        out = [1] * size
        for pos, f in factors.items():
            if not 0 <= pos < size:
                raise BalanceError(f"throttled position {pos} is outside the data axis of size {size}")
            out[pos] = f
        return Throttle(tuple(out), microbatch_seconds)

    @staticmethod
    def for_processes(
        mesh: Mesh, axis: Axes, factors: Mapping[int, int], microbatch_seconds: float | None = None
    ) -> Throttle:
        """Throttle every data-axis position whose devices belong to one of the processes in ``factors``."""
        owners = data_axis_processes(mesh, axis)
        unknown = set(factors) - set(owners)
        if unknown:
            raise BalanceError(
                f"processes {sorted(unknown)} own no device of mesh axis {axis!r} (owners: {sorted(set(owners))})"
            )
        return Throttle(tuple(factors.get(p, 1) for p in owners), microbatch_seconds)

    @property
    def stalls(self) -> bool:
        """Whether the extra time is a stall (else real work)."""
        return self.microbatch_seconds is not None

    @property
    def extra(self) -> np.ndarray:
        """Extra gradient evaluations per microbatch, one per data position (int32; zeros when stalling)."""
        return np.zeros(len(self.factors), np.int32) if self.stalls else np.asarray(self.factors, np.int32) - 1

    @property
    def stall_seconds(self) -> np.ndarray:
        """Seconds of stall per microbatch, one per data position (float32; zeros for real-work throttles)."""
        if not self.stalls:
            return np.zeros(len(self.factors), np.float32)
        return (np.asarray(self.factors, np.float32) - 1) * np.float32(self.microbatch_seconds)


def data_axis_processes(mesh: Mesh, axis: Axes) -> tuple[int, ...]:
    """The process owning each position of ``axis`` (one axis or several; the first device of that slice)."""
    axes = as_axes(axis)
    if not axes or any(a not in mesh.axis_names for a in axes):
        raise BalanceError(f"expected axis {axis!r} to name axes of the mesh {mesh.axis_names}; pass one of them")
    where = [mesh.axis_names.index(a) for a in axes]
    devs = np.moveaxis(mesh.devices, where, list(range(len(where))))
    firsts = devs.reshape(axes_size(mesh, axis), -1)[:, 0]
    return tuple(int(d.process_index) for d in firsts)
