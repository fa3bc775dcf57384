"""Per-device memory of a run: predicted from the plan's specs, resident from the arrays, compiled from XLA.

* ``predicted``: params / grads / optimizer bytes per device from the plan's PartitionSpecs and the mesh sizes,
  and activations as the plan's ``predicted_bytes`` minus that state (when the planner predicted a total).
* ``compiled``: ``memory_analysis()`` of the compiled step (arguments, outputs, temporaries, aliased, peak).
* ``per_device``: the bytes of params and optimizer state actually resident on each device (addressable shards).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from openhosti_jax.report.memory import tree_spec_bytes
    >>> tree_spec_bytes({"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}, {"w": P("fsdp", None)}, {"fsdp": 8})
    32768
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import PlanReport
from openhosti_jax.sharding.specs import is_spec, local_bytes
from openhosti_jax.state.jit import memory_stats


def tree_spec_bytes(tree: Any, specs: Any, mesh_shape: Mapping[str, int]) -> int:
    """Per-device bytes of every leaf of ``tree`` under the matching leaf of ``specs``."""
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    return sum(local_bytes(x, s, mesh_shape) for x, s in zip(leaves, spec_leaves, strict=True))


def predicted_memory(
    plan: ShardingPlan, params: Any, opt_state: Any, predicted_bytes: int | None = None
) -> dict[str, int | None]:
    """``{"params", "grads", "optimizer", "activations"}`` per-device bytes predicted from the plan's specs; the
    activations are ``predicted_bytes`` (the planner's total) less that state, when given."""
    out: dict[str, int | None] = {
        "params": tree_spec_bytes(params, plan.param_specs, plan.mesh_shape),
        "grads": tree_spec_bytes(params, plan.grad_specs, plan.mesh_shape),
        "optimizer": tree_spec_bytes(opt_state, plan.opt_specs, plan.mesh_shape),
    }
    state = out["params"] + out["grads"] + out["optimizer"]
    out["activations"] = max(predicted_bytes - state, 0) if predicted_bytes else None
    return out


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int] | None:
    """``memory_analysis()`` fields per device, or ``None`` when the backend reports nothing."""
    return memory_stats(compiled)


def resident_memory(state: Any) -> list[dict[str, int]]:
    """Per device (by id): bytes of the ``params`` and ``opt_state`` shards it holds."""
    rows: dict[int, dict[str, int]] = {}
    for name in ("params", "opt_state"):
        for x in jax.tree.leaves(getattr(state, name)):
            if not isinstance(x, jax.Array):
                continue
            for shard in x.addressable_shards:
                row = rows.setdefault(shard.device.id, {"device": shard.device.id, "params": 0, "opt_state": 0})
                row[name] += shard.data.nbytes
    return [rows[k] for k in sorted(rows)]


def plan_record(report: PlanReport, state: Any, compiled: jax.stages.Compiled | None = None) -> dict[str, Any]:
    """The ``plan.json`` record: the plan, its report, and the memory breakdown for ``state`` (and ``compiled``)."""
    plan = report.plan
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state.params, state.opt_state))
    comp = compiled_memory(compiled) if compiled is not None else None
    return {
        "mesh": dict(plan.mesh_shape),
        "zero_stage": plan.zero_stage,
        "num_microbatches": plan.num_microbatches,
        "pipeline_stages": plan.pipeline_stages,
        "data_parallel_size": plan.data_parallel_size,
        "predicted_bytes": report.predicted_bytes,
        "compiled_bytes": report.compiled_bytes,
        "notes": [*report.notes, *report.events],
        "memory": {
            "predicted": predicted_memory(plan, *abstract, report.predicted_bytes),
            "compiled": comp,
            "per_device": resident_memory(state),
        },
    }
