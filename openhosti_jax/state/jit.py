"""The small core that jits a train step under a plan, and reads what the compiled step needs per device.

`jit_step` places the state and batch by the plan, donates the state, and makes the plan's gradient shardings and
microbatch count active while the step is traced (so `TrainState.apply_gradients` reduce-scatters under ZeRO-2/3
and `make_train_step` accumulates). ``@spmd``, the planner's AOT verification and its measured refinement all
compile through it. Per-device bytes = arguments + outputs + temporaries - aliased (donated) bytes; a backend that
reports all zeros gives ``None`` (unknown), never 0.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.state.jit import memory_bytes
    >>> c = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((1024,), jnp.float32)).compile()
    >>> memory_bytes(c) >= 4096
    True
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.state.context import active_gradient_shardings, active_microbatches
from openhosti_jax.state.contracts import StepFn
from openhosti_jax.state.init import state_specs


def jit_step(
    fn: StepFn,
    plan: ShardingPlan,
    mesh: Mesh,
    state: Any,
    batch: Any,
    *,
    donate: bool = True,
    num_microbatches: int | None = None,
) -> tuple[Any, Any]:
    """(``fn`` jitted with the plan's in/out shardings for arguments shaped like ``state`` and ``batch``, the
    state's shardings). Metrics come back replicated. ``num_microbatches`` defaults to the plan's."""
    k = num_microbatches or plan.num_microbatches
    state_sh = plan.shardings(mesh, state_specs(plan, state))
    grad_sh = plan.shardings(mesh, plan.grad_specs)
    batch_sh = plan.batch_shardings(mesh, batch)

    def traced(s: Any, b: Any) -> tuple[Any, Any]:
        with active_gradient_shardings(grad_sh), active_microbatches(k):
            return fn(s, b)

    jitted = jax.jit(
        traced,
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, NamedSharding(mesh, P())),
        donate_argnums=(0,) if donate else (),
    )
    return jitted, state_sh


def memory_stats(compiled: jax.stages.Compiled) -> dict[str, int] | None:
    """``memory_analysis()`` fields per device (argument, output, temp, alias, peak); ``None`` when unreported.

    All-zero fields (some GPU/TPU builds) count as unreported.
    """
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    out = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
        "peak": int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
    }
    return out if any(out.values()) else None


def footprint_bytes(stats: dict[str, int]) -> int:
    """The buffer assignment's footprint: arguments + temporaries + outputs not aliased to donated arguments."""
    return stats["argument"] + stats["temp"] + stats["output"] - stats["alias"]


def memory_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Per-device footprint bytes of a compiled program (None when the backend does not report them)."""
    stats = memory_stats(compiled)
    if stats is None:
        return None
    total = footprint_bytes(stats)
    return total if total > 0 else None
