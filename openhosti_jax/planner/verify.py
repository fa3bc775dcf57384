"""AOT verification: compile the real train step for a plan from abstract state and read XLA's memory analysis.

Per-device bytes = arguments + outputs + temporaries - aliased (donated) bytes. A backend that reports all
zeros gives ``None`` (unknown), never 0. ``peak_memory_in_bytes`` is not used: on CPU it reports about the
argument size only.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.planner.verify import memory_bytes
    >>> c = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((1024,), jnp.float32)).compile()
    >>> memory_bytes(c) >= 4096
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from openhosti_jax.microbatch.probe import footprint_bytes, memory_stats
from openhosti_jax.planner.plan import ShardingPlan
from openhosti_jax.planner.workload import Workload
from openhosti_jax.state.train_state import TrainState

StepFn = Callable[[TrainState, Any], tuple[TrainState, Any]]


def memory_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Per-device bytes of a compiled program (None when the backend does not report them)."""
    stats = memory_stats(compiled)
    if stats is None:
        return None
    total = footprint_bytes(stats)
    return total if total > 0 else None


def abstract_state(work: Workload, tx: optax.GradientTransformation) -> TrainState:
    """The `TrainState` for ``work`` as abstract leaves."""
    apply = work.apply_fn

    def build(params: Any, key: jax.Array) -> TrainState:
        return TrainState.create(apply_fn=apply, params=params, tx=tx, rng=key, model_state=work.model_state)

    return jax.eval_shape(build, work.params, jax.random.key(0))


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


def lower_step(
    plan: ShardingPlan, work: Workload, tx: optax.GradientTransformation, step_fn: StepFn, mesh: Mesh
) -> jax.stages.Lowered:
    """The step lowered with the plan's shardings and donation, from abstract state and batch."""
    from openhosti_jax.train.step import spmd

    return spmd(step_fn, mesh=mesh, plan=plan).lower(abstract_state(work, tx), work.batch)


def compiled_step_bytes(
    plan: ShardingPlan, work: Workload, tx: optax.GradientTransformation, step_fn: StepFn, mesh: Mesh
) -> int | None:
    """Per-device bytes of the compiled step (None when the backend does not say)."""
    return memory_bytes(lower_step(plan, work, tx, step_fn, mesh).compile())
