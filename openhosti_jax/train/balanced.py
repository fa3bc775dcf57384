"""`balanced_step`: a train step whose microbatches are spread over the data-parallel devices by measured speed.

It is built from a ``loss_sum_fn(params, microbatch, rng) -> (loss_sum, num_real)``
(`openhosti_jax.state.SummedLossFn`): each global batch is cut into ``microbatches`` pieces, a
`openhosti_jax.balance.Balancer` gives a slow device fewer of them, and the gradient stays the exact mean over all
real samples.

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

from openhosti_jax.balance import Balancer
from openhosti_jax.errors import BatchError, ShardingError, StateError
from openhosti_jax.sharding.plan import ShardingPlan
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
        axis: str = "data",
        **balancer_kw: Any,
    ):
        if plan.zero_stage == 3 and plan.mesh_shape.get("fsdp", 1) > 1:
            raise ShardingError(
                "a balanced step needs parameters replicated over the data-parallel devices, found a ZeRO-3 plan "
                "sharding them on fsdp; use plan='dp', 'zero1' or 'zero2'"
            )
        self.mesh, self.plan, self.microbatches = mesh, plan, microbatches
        self.balancer = Balancer(loss_sum_fn, mesh, total=microbatches, axis=axis, **balancer_kw)
        sh = plan.shardings(mesh, plan.param_specs)
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

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        def split(x: Any) -> np.ndarray:
            x = np.asarray(x)
            if x.shape[0] % self.microbatches:
                raise BatchError(
                    f"batch leading dim {x.shape[0]} is not divisible by microbatches={self.microbatches}; "
                    "use a batch that is a multiple of it"
                )
            return x.reshape(self.microbatches, x.shape[0] // self.microbatches, *x.shape[1:])

        old_rng = state.rng
        state, rng = self._next_rng(state)
        with jax.set_mesh(self.mesh):
            loss, grads, n_real = self.balancer(state.params, jax.tree.map(split, batch), rng)
            state, checked = self._apply(state, grads, loss, old_rng)
        metrics = {"loss": loss, "num_real": n_real, "counts": list(self.balancer.counts)}
        return state, {**metrics, "grad_norm": checked["grad_norm"], "skipped_nonfinite": checked["skipped_nonfinite"]}


def balanced_step(
    loss_sum_fn: SummedLossFn, *, mesh: Mesh, plan: ShardingPlan, microbatches: int | None = None, **balancer_kw: Any
) -> BalancedStep:
    """A `BalancedStep` for ``loss_sum_fn`` on ``mesh`` by ``plan`` (ZeRO 0-2: parameters replicated over ``data``).

    Every global batch is cut into ``microbatches`` pieces (default 4 per data-parallel device) that a
    `openhosti_jax.balance.Balancer` spreads over the devices by measured speed; ``balancer_kw`` go to it.
    """
    if not isinstance(plan, ShardingPlan) or not isinstance(mesh, Mesh):
        raise StateError(
            f"balanced_step needs mesh= a jax Mesh and plan= a ShardingPlan, found {type(mesh).__name__} and "
            f"{type(plan).__name__}; create both with create_train_state"
        )
    return BalancedStep(
        loss_sum_fn, mesh, plan, microbatches=microbatches or 4 * plan.mesh_shape["data"], **balancer_kw
    )
