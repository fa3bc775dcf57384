"""`Balancer`: the balanced step, a `Monitor` and a `Rebalancer` driven together, one call per training step.

Each call packs the step's microbatches by the current counts, runs the balanced gradient (a timed probe every
``every`` steps), and after a probe moves the counts towards the measured speeds. The gradient is the exact
global mean whatever the counts; only the time changes.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from openhosti_jax.balance import Balancer
    >>> mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    >>> loss_sum_fn = lambda p, mb, rng: (jnp.sum((mb["x"] * p["w"]) ** 2), jnp.float32(mb["x"].size))
    >>> bal = Balancer(loss_sum_fn, mesh, total=8, every=1)
    >>> loss, grads, n = bal({"w": jnp.float32(1.0)}, {"x": np.ones((8, 2), np.float32)}, jax.random.key(0))
    >>> float(loss), int(n), sum(bal.counts)
    (1.0, 16, 8)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from openhosti_jax.balance.buffer import Axes, axes_size, place_microbatches
from openhosti_jax.balance.grad import make_balanced_grad_fn
from openhosti_jax.balance.monitor import Monitor
from openhosti_jax.balance.rebalancer import Rebalancer, describe_assignment
from openhosti_jax.balance.throttle import Throttle
from openhosti_jax.errors import BalanceError
from openhosti_jax.state.contracts import SummedLossFn


def slots_for(counts: Sequence[int], total: int, size: int, capacity: int) -> int:
    """Buffer slots per device for ``counts``: the even share times a power of two (few shapes, few compiles)."""
    share = max(1, -(-total // size))
    need = max(max(counts), 1)
    slots = share
    while slots < need:
        slots *= 2
    return min(slots, capacity)


class Balancer:
    """``bal(params, microbatches [total, ...], rng) -> (loss, grads, n_real)``, rebalancing as it goes.

    No fixed cap: ``capacity`` (the most microbatches one device may take) defaults to ``total``, the buffer grows
    with the largest count, and a device whose share rounds to nothing gets no work (``floor=0``). Such a device
    is retried with one microbatch on a probe step after ``retry`` probes at zero, its stale samples forgotten,
    so it comes back once it is fast again. ``failed`` devices get no work. ``axis`` may name several mesh axes;
    ``grad_shardings`` (ZeRO-3 / FSDP) and ``gather`` go to `make_balanced_grad_fn`.
    """

    def __init__(
        self,
        loss_sum_fn: SummedLossFn,
        mesh: Mesh,
        *,
        total: int,
        axis: Axes = "data",
        capacity: int | None = None,
        every: int = 10,
        alpha: float = 0.5,
        hysteresis: float = 0.05,
        floor: int = 0,
        retry: int = 3,
        throttle: Throttle | None = None,
        failed: Sequence[int] = (),
        grad_shardings: Any = None,
        gather: str = "step",
    ):
        size = axes_size(mesh, axis)
        capacity = total if capacity is None else capacity
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 1:
            raise BalanceError(f"expected retry= an int >= 1 (probes a device waits at zero work), found {retry!r}")
        synced = gather == "microbatch"
        self.rebalancer = Rebalancer(
            total=total, size=size, capacity=capacity, hysteresis=hysteresis, floor=floor, synced=synced
        )
        self.monitor = Monitor(size, every=every, alpha=alpha)
        self.step_fn = make_balanced_grad_fn(
            loss_sum_fn,
            mesh,
            axis=axis,
            capacity=capacity,
            throttle=throttle,
            grad_shardings=grad_shardings,
            gather=gather,
        )
        self.failed = tuple(failed)
        self.retry = retry
        self.counts = self.rebalancer.update((), [1.0] * size, self.failed)
        """The assignment the next step runs with."""
        self.steps = 0
        self._idle = [0] * size  # probes each live device has spent at zero work
        self._probe_next = False
        self._slots = 0

    def __call__(self, params: Any, microbatches: Any, rng: jax.Array):
        fn = self.step_fn
        buffer = place_microbatches(microbatches, self.counts, self.buffer_slots(), fn.mesh, fn.axis)
        return self.run(params, buffer, rng)

    def run(self, params: Any, buffer: Any, rng: jax.Array):
        """One step on a buffer already placed for `counts` (`place_microbatches` or a host-local batch)."""
        fn = self.step_fn
        if not (self._probe_next or self.monitor.should_probe(self.steps)):
            out = fn(params, buffer, self.counts, rng)
        else:
            out, seconds = fn.probe(params, buffer, self.counts, rng)
            self.monitor.observe(seconds, self.counts)
            self._probe_next = False
            if self.monitor.ready:
                self.counts = self.rebalancer.update(self.counts, self.monitor.speeds(), self.failed)
                self._maybe_retry()
        self.steps += 1
        return out

    def buffer_slots(self) -> int:
        """Slots per device of the next step's buffer: they only grow (each size is one more compile)."""
        need = slots_for(self.counts, self.rebalancer.total, self.step_fn.size, self.step_fn.capacity)
        self._slots = max(self._slots, need)
        return self._slots

    def _maybe_retry(self) -> None:
        """Give one microbatch to each live device that sat at zero for ``retry`` probes, and probe next step."""
        counts = list(self.counts)
        for i, c in enumerate(counts):
            self._idle[i] = self._idle[i] + 1 if c == 0 and i not in self.failed else 0
        for i in [i for i in range(len(counts)) if self._idle[i] >= self.retry]:
            donor = max(range(len(counts)), key=lambda d: (counts[d], -d))
            if counts[donor] < 2:
                break
            counts[donor] -= 1
            counts[i] += 1
            self._idle[i] = 0
            self.monitor.forget(i)
            self._probe_next = True
        self.counts = tuple(counts)

    def speeds(self) -> list[float | None]:
        """Measured microbatches per second per device (None where not yet measured): a metric to log."""
        spmb = self.monitor.seconds_per_microbatch
        return [None if not np.isfinite(v) else float(1.0 / v) for v in spmb]

    def describe(self) -> str | None:
        """The current assignment for a progress line when uneven (``"mb/device 9/9/8/2"``), else None."""
        return describe_assignment(self.counts)
