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
from jax.sharding import Mesh

from openhosti_jax.balance.buffer import place_microbatches
from openhosti_jax.balance.grad import make_balanced_grad_fn
from openhosti_jax.balance.monitor import Monitor
from openhosti_jax.balance.rebalancer import Rebalancer, describe_assignment
from openhosti_jax.balance.throttle import Throttle
from openhosti_jax.state.contracts import SummedLossFn


class Balancer:
    """``bal(params, microbatches [total, ...], rng) -> (loss, grads, n_real)``, rebalancing as it goes.

    ``capacity`` defaults to twice the even share (at most ``total``); ``failed`` devices get no work.
    """

    def __init__(
        self,
        loss_sum_fn: SummedLossFn,
        mesh: Mesh,
        *,
        total: int,
        axis: str = "data",
        capacity: int | None = None,
        every: int = 10,
        alpha: float = 0.5,
        hysteresis: float = 0.05,
        throttle: Throttle | None = None,
        failed: Sequence[int] = (),
    ):
        size = mesh.shape[axis] if axis in mesh.axis_names else 0
        if capacity is None:
            capacity = min(total, 2 * -(-total // max(size, 1)))
        self.rebalancer = Rebalancer(total=total, size=size, capacity=capacity, hysteresis=hysteresis)
        self.monitor = Monitor(size, every=every, alpha=alpha)
        self.step_fn = make_balanced_grad_fn(loss_sum_fn, mesh, axis=axis, capacity=capacity, throttle=throttle)
        self.failed = tuple(failed)
        self.counts = self.rebalancer.update((), [1.0] * size, self.failed)
        """The assignment the next step runs with."""
        self.steps = 0

    def __call__(self, params: Any, microbatches: Any, rng: jax.Array):
        fn = self.step_fn
        buffer = place_microbatches(microbatches, self.counts, fn.capacity, fn.mesh, fn.axis)
        if not self.monitor.should_probe(self.steps):
            out = fn(params, buffer, self.counts, rng)
        else:
            out, seconds = fn.probe(params, buffer, self.counts, rng)
            self.monitor.observe(seconds, self.counts)
            if self.monitor.ready:
                self.counts = self.rebalancer.update(self.counts, self.monitor.speeds(), self.failed)
        self.steps += 1
        return out

    def describe(self) -> str | None:
        """The current assignment for a progress line when uneven (``"mb/device 9/9/8/2"``), else None."""
        return describe_assignment(self.counts)
