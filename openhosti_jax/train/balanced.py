"""`balanced_step`: a train step whose microbatches are spread over the data-parallel devices by measured speed.

It is built from a ``loss_sum_fn(params, microbatch, rng) -> (loss_sum, num_real)``
(`openhosti_jax.state.SummedLossFn`): each global batch is cut into ``microbatches`` pieces, a
`openhosti_jax.balance.Balancer` gives a slow device fewer of them, and the gradient stays the exact mean over all
real samples. Every device along the plan's batch axes (``data`` and ``fsdp``) is one balanced position. Under
ZeRO-3 / FSDP the sharded parameters are gathered once per step before the uneven local loop (so the step holds
the full parameters and one full gradient accumulator per device, as ZeRO-2 does, while the train state stays
sharded) and the gradient is reduce-scattered back onto the shards; ``gather="microbatch"`` keeps them sharded
and gathers them in every iteration of a masked loop instead (`openhosti_jax.balance.gathered`). A batch may also be a
`openhosti_jax.balance.HostLocalBatch` (from `openhosti_jax.balance.HostLocalData`): each process then reads
only the samples its devices run. The metrics carry ``counts`` (microbatches per position) and
``device_speeds`` (measured microbatches per second, None before a position was measured).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> import openhosti_jax as oh
    >>> mesh = oh.build_mesh(oh.MeshConfig(data=4), devices=jax.devices()[:4])
    >>> state, plan = oh.create_train_state(lambda r: {"w": jnp.ones(2)}, optax.sgd(0.1), mesh, plan="dp")
    >>> loss_sum_fn = lambda p, mb, rng: (jnp.sum((mb["x"] @ p["w"]) ** 2), jnp.float32(mb["x"].shape[0]))
    >>> step = oh.balanced_step(loss_sum_fn, mesh=mesh, plan=plan, microbatches=8)
    >>> state, m = step(state, {"x": np.ones((16, 2), np.float32)})
    >>> float(m["loss"]), int(state.step)
    (4.0, 1)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from openhosti_jax.balance import Balancer, HostLocalBatch, place_microbatches
from openhosti_jax.errors import BalanceError, BatchError, ShardingError, StateError
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.specs import spec_axes
from openhosti_jax.state.contracts import SummedLossFn
from openhosti_jax.state.guard import all_finite
from openhosti_jax.state.train_state import TrainState


class BalancedStep:
    """``step(state, batch) -> (state, metrics)`` with per-device microbatch counts that follow measured speed."""

    def __init__(
        self,
        loss_sum_fn: SummedLossFn,
        mesh: Mesh,
        plan: ShardingPlan,
        *,
        microbatches: int,
        axis: str | tuple[str, ...] | None = None,
        **balancer_kw: Any,
    ):
        unsupported = {a: plan.mesh_shape.get(a, 1) for a in ("stage", "context") if plan.mesh_shape.get(a, 1) > 1}
        if unsupported:
            raise ShardingError(
                f"a balanced step splits whole rows over the batch axes; expected no pipeline or sequence split, "
                f"found {unsupported}; balance a plan without them"
            )
        if axis is None:
            axis = spec_axes(jax.sharding.PartitionSpec(*tuple(plan.batch_spec)[:1]))
        self.mesh, self.plan, self.microbatches, self.axis = mesh, plan, microbatches, axis
        sh = plan.shardings(mesh, plan.param_specs)
        self.balancer = Balancer(loss_sum_fn, mesh, total=microbatches, axis=axis, grad_shardings=sh, **balancer_kw)
        self.size = self.balancer.step_fn.size
        self._next_rng = jax.jit(lambda s: s.next_rng())

        def apply(s: TrainState, grads: Any, loss: jax.Array, old_rng: jax.Array) -> tuple[TrainState, Any]:
            ok = all_finite((loss, grads))  # a skipped step keeps the state, its key included, as it was
            new = jax.lax.cond(
                ok,
                lambda t, g: t.apply_gradients(grads=jax.lax.with_sharding_constraint(g, sh)),
                lambda t, g: t.replace(rng=old_rng),
                s,
                grads,
            )
            return new, {
                "grad_norm": optax.tree.norm(grads),
                "skipped_nonfinite": jnp.logical_not(ok).astype(jnp.int32),
            }

        self._apply = jax.jit(apply, donate_argnums=0)

    def progress_note(self) -> str | None:
        """The current assignment when it is uneven (shown on the Trainer's progress line)."""
        return self.balancer.describe()

    def _buffer(self, batch: Any) -> Any:
        """The step's microbatch buffer, placed for the current counts (each process fills its own devices)."""
        bal = self.balancer
        rows = batch.global_batch_size if isinstance(batch, HostLocalBatch) else None
        if rows is None:
            leaves = jax.tree.leaves(batch)
            rows = np.shape(leaves[0])[0] if leaves and np.ndim(leaves[0]) else 0
        if rows < self.size:
            raise BalanceError(
                f"the global batch has {rows} rows, fewer than the {self.size} balanced devices; use a global batch "
                f"of at least {self.size} rows (a multiple of microbatches={self.microbatches})"
            )
        if isinstance(batch, HostLocalBatch):
            if batch.microbatches != self.microbatches:
                raise BatchError(
                    f"the host-local batch is cut into {batch.microbatches} microbatches, the step into "
                    f"{self.microbatches}; build HostLocalData with microbatches={self.microbatches}"
                )
            return batch.place(bal.counts, bal.buffer_slots(), self.mesh, self.axis)

        def split(x: Any) -> np.ndarray:
            x = np.asarray(x)
            if x.shape[0] % self.microbatches:
                raise BatchError(
                    f"batch leading dim {x.shape[0]} is not divisible by microbatches={self.microbatches}; "
                    "use a batch that is a multiple of it"
                )
            return x.reshape(self.microbatches, x.shape[0] // self.microbatches, *x.shape[1:])

        return place_microbatches(jax.tree.map(split, batch), bal.counts, bal.buffer_slots(), self.mesh, self.axis)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        old_rng = state.rng
        counts = list(self.balancer.counts)
        buffer = self._buffer(batch)
        state, rng = self._next_rng(state)
        with jax.set_mesh(self.mesh):
            loss, grads, n_real = self.balancer.run(state.params, buffer, rng)
            state, checked = self._apply(state, grads, loss, old_rng)
        metrics = {"loss": loss, "num_real": n_real, "counts": counts, "device_speeds": self.balancer.speeds()}
        return state, {**metrics, "grad_norm": checked["grad_norm"], "skipped_nonfinite": checked["skipped_nonfinite"]}


def balanced_step(
    loss_sum_fn: SummedLossFn, *, mesh: Mesh, plan: ShardingPlan, microbatches: int | None = None, **balancer_kw: Any
) -> BalancedStep:
    """A `BalancedStep` for ``loss_sum_fn`` on ``mesh`` by ``plan`` (any ZeRO stage, FSDP included).

    Every global batch is cut into ``microbatches`` pieces (default 4 per balanced device) that a
    `openhosti_jax.balance.Balancer` spreads over the devices by measured speed; ``balancer_kw`` go to it.
    """
    if not isinstance(plan, ShardingPlan) or not isinstance(mesh, Mesh):
        raise StateError(
            f"balanced_step needs mesh= a jax Mesh and plan= a ShardingPlan, found {type(mesh).__name__} and "
            f"{type(plan).__name__}; create both with create_train_state"
        )
    return BalancedStep(
        loss_sum_fn, mesh, plan, microbatches=microbatches or 4 * plan.data_parallel_size, **balancer_kw
    )
