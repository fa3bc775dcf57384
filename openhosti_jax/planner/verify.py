"""AOT verification: compile the train step for a plan from abstract state and batch, and read XLA's memory
analysis (`openhosti_jax.state.jit.memory_bytes`). Nothing is allocated.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from openhosti_jax import build_mesh, MeshConfig
    >>> from openhosti_jax.sharding import ShardingPlan
    >>> from openhosti_jax.planner.verify import compiled_step_bytes
    >>> from openhosti_jax.planner.workload import workload
    >>> work = workload(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((8, 64), jnp.float32))
    >>> plan = ShardingPlan.from_zero(work.params, optax.sgd(0.1), {"data": 8}, 0)
    >>> compiled_step_bytes(plan, work, optax.sgd(0.1), default_step, build_mesh(MeshConfig(data=8))) > 16384
    True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from openhosti_jax.planner.workload import Workload
from openhosti_jax.policies.optimizers import optimizer_for
from openhosti_jax.policies.precision import precision as resolve_precision
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.zero import Optimizer
from openhosti_jax.state.context import active_microbatches
from openhosti_jax.state.contracts import StepFn
from openhosti_jax.state.jit import jit_step, memory_bytes
from openhosti_jax.state.train_state import TrainState


def abstract_state(work: Workload, tx: Optimizer, precision: str = "fp32") -> Any:
    """The abstract state the step takes: the user's (``work.state``), else a `TrainState` for ``work`` with its
    parameters in ``precision``'s dtype and ``tx`` keeping what that precision needs (a master copy)."""
    if work.state is not None:
        return work.state
    apply = work.apply_fn
    tx = optimizer_for(tx, precision)
    params = resolve_precision(precision).cast_to_param(work.params)

    def build(params: Any, key: jax.Array) -> TrainState:
        return TrainState.create(apply_fn=apply, params=params, tx=tx, rng=key, model_state=work.model_state)

    return jax.eval_shape(build, params, jax.random.key(0))


def step_accumulates(work: Workload, tx: Optimizer, step_fn: StepFn) -> bool:
    """Whether ``step_fn`` reads the microbatch count (`openhosti_jax.make_train_step` does), so a plan may
    accumulate gradients over microbatches."""
    with active_microbatches(2) as count:
        jax.eval_shape(step_fn, abstract_state(work, tx), work.batch)
    return count.read


def default_step(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
    """A step with the mean floating output as its loss (used when no ``step_fn`` is given)."""

    def loss(p: Any) -> jax.Array:
        out = state.apply_fn(p, batch, model_state=state.model_state)
        leaves = [
            jnp.mean(x.astype(jnp.float32)) for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)
        ]
        return sum(leaves, jnp.float32(0.0))

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def lower_step(plan: ShardingPlan, work: Workload, tx: Optimizer, step_fn: StepFn, mesh: Mesh) -> jax.stages.Lowered:
    """The step lowered with the plan's shardings and donation, from abstract state and batch."""
    state = abstract_state(work, tx, plan.precision)
    fn, _ = jit_step(step_fn, plan, mesh, state, work.batch, layout=work.layout)
    with jax.set_mesh(mesh):
        return fn.lower(state, work.batch)


def compiled_step_bytes(plan: ShardingPlan, work: Workload, tx: Optimizer, step_fn: StepFn, mesh: Mesh) -> int | None:
    """Per-device bytes of the compiled step (None when the backend does not say)."""
    return memory_bytes(lower_step(plan, work, tx, step_fn, mesh).compile())
