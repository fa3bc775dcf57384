"""When to pipeline: the decision the planner and ``@spmd`` take from the cost model's numbers.

Pipelining is *needed* when the model's per-device memory without stages exceeds the budget, and *wins*
when its predicted step time beats the unpipelined one. `fewest_stages` finds the smallest stage count whose
best cut fits.

Example:
    >>> should_pipeline(per_device_memory_bytes=3e9, budget_bytes=2e9).use_pipeline
    True
    >>> should_pipeline(1e9, 2e9, unpipelined_step_s=1.0, pipelined_step_s=1.2).use_pipeline
    False
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from openhosti_jax.errors import PipelineError
from openhosti_jax.pipeline.costs import LayerCost
from openhosti_jax.pipeline.partition import StageCostModel, StagePartition, partition
from openhosti_jax.pipeline.schedule import Schedule
from openhosti_jax.pipeline.simulate import simulate


@dataclass(frozen=True)
class PipelineAdvice:
    """Whether to use pipeline stages, and why."""

    use_pipeline: bool
    """``needed or wins``."""
    needed: bool
    """The unpipelined model does not fit the per-device budget."""
    wins: bool
    """The pipelined step is predicted faster than the unpipelined one."""
    reason: str
    """One line for the plan's printout."""


def should_pipeline(
    per_device_memory_bytes: float,
    budget_bytes: float,
    *,
    unpipelined_step_s: float | None = None,
    pipelined_step_s: float | None = None,
) -> PipelineAdvice:
    """Decide from predicted memory (without stages) and, when both are given, predicted step times."""
    if budget_bytes <= 0 or per_device_memory_bytes < 0:
        raise PipelineError(
            f"expected budget_bytes > 0 and per_device_memory_bytes >= 0, found {budget_bytes}, "
            f"{per_device_memory_bytes}"
        )
    needed = per_device_memory_bytes > budget_bytes
    timed = unpipelined_step_s is not None and pipelined_step_s is not None
    wins = timed and pipelined_step_s < unpipelined_step_s
    if needed:
        reason = f"needs {per_device_memory_bytes:.4g} B per device without stages, budget {budget_bytes:.4g} B"
    elif wins:
        reason = f"predicted step {pipelined_step_s:.4g} s pipelined vs {unpipelined_step_s:.4g} s without"
    else:
        reason = "fits without stages" + (" and is not predicted faster pipelined" if timed else "")
    return PipelineAdvice(needed or wins, needed, wins, reason)


def predicted_step_time(
    partition_: StagePartition, schedule: Schedule, backward_ratio: float = 2.0, comm_time: float = 0.0
) -> float:
    """Makespan of ``schedule`` played with the partition's stage times (split into forward / backward)."""
    if partition_.num_stages != schedule.num_chunks:
        raise PipelineError(
            f"partition has {partition_.num_stages} stages, schedule runs {schedule.num_chunks} chunks; match them"
        )
    fwd = [t / (1.0 + backward_ratio) for t in partition_.stage_times]
    return simulate(schedule, fwd, [f * backward_ratio for f in fwd], comm_time).makespan


def fewest_stages(
    costs: Sequence[LayerCost],
    budget_bytes: float,
    num_microbatches: int,
    candidates: Iterable[int],
    model: StageCostModel | None = None,
) -> StagePartition:
    """The best partition for the smallest candidate stage count whose every stage fits ``budget_bytes``."""
    tried = []
    for s in sorted(set(candidates)):
        if s > len(costs):
            break
        try:
            return partition(costs, s, num_microbatches, memory_cap=budget_bytes, model=model)
        except PipelineError as e:
            tried.append(f"S={s}: {e}")
    raise PipelineError(
        f"no stage count in {sorted(set(candidates))} fits {budget_bytes:.4g} B per stage "
        f"({len(costs)} layers): " + " | ".join(tried[-2:])
    )
