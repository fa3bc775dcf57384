"""Cut a sequence of layers into contiguous pipeline stages by exact dynamic programming.

The objective is Alpa's pipeline latency ``sum(t_s) + (M - 1) * max(t_s)`` for ``M`` microbatches (``"alpa"``)
or the slowest stage alone (``"max"``), subject to a per-stage memory cap. Stage time is forward plus backward
(``1 + backward_ratio`` times the forward estimate) plus the time to send its output to the next stage.
Stage memory is the parameter state (params, grads, optimizer moments), the stage inputs kept for the
microbatches in flight (the executor recomputes the rest in backward) and one microbatch's activations.

Example:
    >>> costs = [LayerCost(0, 0, 10, 4, 4, t) for t in (1.0, 1.0, 1.0, 5.0)]
    >>> p = partition(costs, num_stages=2, num_microbatches=4)
    >>> p.boundaries
    (0, 3, 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from openhosti_jax.errors import PipelineError
from openhosti_jax.pipeline.costs import LayerCost

Objective = Literal["alpa", "max"]


@dataclass(frozen=True)
class StageCostModel:
    """How layer costs add up to a stage's time and memory."""

    backward_ratio: float = 2.0
    """Backward time / forward time of a layer."""
    state_bytes_factor: float = 4.0
    """Bytes of training state per parameter byte (params + grads + two Adam moments = 4)."""
    link_bandwidth: float | None = None
    """Bytes/s between neighbouring stages; ``None`` ignores the send time."""
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Schedule whose in-flight count sizes stored activations: GPipe keeps M, 1F1B ``S - s`` at stage s."""

    def __post_init__(self) -> None:
        if not self.backward_ratio >= 0:
            raise PipelineError(f"backward_ratio must be >= 0, found {self.backward_ratio}")
        if not self.state_bytes_factor >= 0:
            raise PipelineError(f"state_bytes_factor must be >= 0, found {self.state_bytes_factor}")
        if self.link_bandwidth is not None and not self.link_bandwidth > 0:
            raise PipelineError(f"link_bandwidth must be > 0 or None, found {self.link_bandwidth}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise PipelineError(f"schedule must be 'gpipe' or '1f1b', found {self.schedule!r}")

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int) -> int:
        """Microbatches whose stage input is kept at ``stage`` at the schedule's peak."""
        if self.schedule == "gpipe":
            return num_microbatches
        return min(num_microbatches, num_stages - stage)


@dataclass(frozen=True)
class StagePartition:
    """Contiguous cuts: stage ``s`` holds layers ``boundaries[s]:boundaries[s + 1]``."""

    boundaries: tuple[int, ...]
    """Stage start indices followed by the layer count."""
    stage_times: tuple[float, ...]
    """Forward + backward (+ send) seconds per microbatch, per stage."""
    stage_memory: tuple[int, ...]
    """Peak bytes per stage under the cost model."""
    num_microbatches: int
    """M used in the objective and the in-flight counts."""
    objective: Objective
    """What was minimised."""

    def __post_init__(self) -> None:
        b = self.boundaries
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise PipelineError(f"boundaries must start at 0 and increase strictly, found {b}")
        if not (len(self.stage_times) == len(self.stage_memory) == len(b) - 1):
            raise PipelineError(f"expected {len(b) - 1} stage times and memories for boundaries {b}")

    @property
    def num_stages(self) -> int:
        """Number of stages (chunks)."""
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        """Number of layers cut."""
        return self.boundaries[-1]

    @property
    def stages(self) -> tuple[range, ...]:
        """The layer indices of each stage."""
        return tuple(range(a, b) for a, b in zip(self.boundaries, self.boundaries[1:], strict=False))

    @property
    def max_stage_time(self) -> float:
        """The slowest stage's time per microbatch."""
        return max(self.stage_times)

    @property
    def value(self) -> float:
        """The objective's value for these cuts."""
        return objective_value(self.stage_times, self.num_microbatches, self.objective)

    def __str__(self) -> str:
        lines = [
            f"StagePartition: {self.num_stages} stages, {self.num_layers} layers, M={self.num_microbatches}, "
            f"{self.objective}={self.value:.4g}",
            f"{'stage':>5} {'layers':>9} {'time_s':>11} {'memory_MiB':>11}",
        ]
        for s, (r, t, m) in enumerate(zip(self.stages, self.stage_times, self.stage_memory, strict=True)):
            lines.append(f"{s:>5} {f'{r.start}-{r.stop - 1}':>9} {t:>11.4g} {m / 2**20:>11.3f}")
        return "\n".join(lines)


def objective_value(stage_times: Sequence[float], num_microbatches: int, objective: Objective) -> float:
    """``sum + (M - 1) * max`` of the stage times (``"alpa"``) or their max (``"max"``)."""
    if objective == "max":
        return float(max(stage_times))
    return float(sum(stage_times) + (num_microbatches - 1) * max(stage_times))


class _Tables:
    """Segment time and memory for every (stage, start, stop), as ``[s, i, j]`` arrays (inf where i >= j)."""

    def __init__(self, costs: Sequence[LayerCost], num_stages: int, m: int, model: StageCostModel) -> None:
        n = len(costs)
        t = np.array([c.time_s for c in costs], dtype=np.float64) * (1.0 + model.backward_ratio)
        pb = np.array([c.param_bytes for c in costs], dtype=np.float64) * model.state_bytes_factor
        act = np.array([c.output_bytes for c in costs], dtype=np.float64)
        inp = np.array([c.input_bytes for c in costs], dtype=np.float64)
        csum = lambda v: np.concatenate([[0.0], np.cumsum(v)])
        ct, cp, ca = csum(t), csum(pb), csum(act)
        i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        valid = i < j
        seg_t = np.where(valid, ct[j] - ct[i], np.inf)
        send = np.zeros_like(seg_t)
        if model.link_bandwidth is not None:
            out_last = np.concatenate([[0.0], act])  # output bytes of layer j - 1
            send = np.where(j < n, out_last[j] / model.link_bandwidth, 0.0)
        self.time = np.where(valid, seg_t + send, np.inf)
        base_mem = np.where(valid, cp[j] - cp[i] + ca[j] - ca[i], np.inf)
        inp_i = np.concatenate([inp, [0.0]])[i]
        flight = np.array([model.in_flight(s, num_stages, m) for s in range(num_stages)], dtype=np.float64)
        self.memory = base_mem[None] + flight[:, None, None] * inp_i[None]
        self.n = n


def _dp(cost: np.ndarray, allowed: np.ndarray, combine: str) -> tuple[float, tuple[int, ...]] | None:
    """Min over contiguous cuts of sum (``"sum"``) or max (``"max"``) of ``cost[s, i, j]`` where allowed."""
    s_count, n1, _ = allowed.shape
    n = n1 - 1
    best = np.full(n1, np.inf)
    best[0] = 0.0
    choice = np.zeros((s_count, n1), dtype=np.int64)
    for s in range(s_count):
        w = np.where(allowed[s], cost[s], np.inf)
        cand = best[:, None] + w if combine == "sum" else np.maximum(best[:, None], w)
        choice[s] = np.argmin(cand, axis=0)
        best = cand[choice[s], np.arange(n1)]
    if not np.isfinite(best[n]):
        return None
    cuts = [n]
    for s in range(s_count - 1, -1, -1):
        cuts.append(int(choice[s, cuts[-1]]))
    return float(best[n]), tuple(reversed(cuts))


def evaluate_partition(
    costs: Sequence[LayerCost],
    boundaries: Sequence[int],
    num_microbatches: int,
    objective: Objective = "alpa",
    model: StageCostModel | None = None,
) -> StagePartition:
    """The `StagePartition` of given cuts (e.g. an equal layer-count split), with its times and memory."""
    model = model or StageCostModel()
    b = tuple(int(x) for x in boundaries)
    if len(b) < 2 or b[0] != 0 or b[-1] != len(costs):
        raise PipelineError(f"boundaries must run from 0 to {len(costs)} layers, found {b}")
    tables = _Tables(costs, len(b) - 1, num_microbatches, model)
    pairs = list(zip(b, b[1:], strict=False))
    return StagePartition(
        boundaries=b,
        stage_times=tuple(float(tables.time[i, j]) for i, j in pairs),
        stage_memory=tuple(int(tables.memory[s, i, j]) for s, (i, j) in enumerate(pairs)),
        num_microbatches=num_microbatches,
        objective=objective,
    )


def partition(
    costs: Sequence[LayerCost],
    num_stages: int,
    num_microbatches: int,
    memory_cap: float | None = None,
    objective: Objective = "alpa",
    model: StageCostModel | None = None,
) -> StagePartition:
    """The optimal contiguous cut of ``costs`` into ``num_stages`` stages, exactly, by dynamic programming.

    ``"max"`` is a min-max DP. ``"alpa"`` enumerates every segment time as a bound on the slowest stage, finds
    the minimum-sum cut under each bound and keeps the best ``sum + (M - 1) * max`` (exact: the optimum's own
    slowest stage is one of the bounds). Raises `PipelineError` with the best achievable value when nothing is
    feasible.
    """
    model = model or StageCostModel()
    n = len(costs)
    if not isinstance(num_stages, int) or num_stages < 1 or num_stages > n:
        raise PipelineError(
            f"expected 1 <= num_stages <= {n} (the number of layers), found {num_stages}; the most stages "
            f"achievable is {n}: use fewer stages or split layers"
        )
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise PipelineError(f"expected num_microbatches >= 1, found {num_microbatches}")
    if objective not in ("alpa", "max"):
        raise PipelineError(f"objective must be 'alpa' or 'max', found {objective!r}")
    tables = _Tables(costs, num_stages, num_microbatches, model)
    finite = np.isfinite(tables.memory)
    allowed = finite if memory_cap is None else finite & (tables.memory <= memory_cap)
    time = tables.time[None].repeat(num_stages, 0)
    min_max = _dp(time, allowed, "max")
    if min_max is None:
        lowest = _dp(tables.memory, finite, "max")
        assert lowest is not None  # any cut into <= n stages has finite memory
        raise PipelineError(
            f"no cut into {num_stages} stages meets memory_cap={memory_cap:.4g} bytes; the minimum "
            f"achievable peak stage memory is {lowest[0]:.4g} bytes (cuts {lowest[1]}): raise the cap, use "
            "more stages, or lower state_bytes_factor (ZeRO) / the microbatch size"
        )
    cuts = min_max[1]
    if objective == "alpa":
        compute_total = float(tables.time[0, n])  # every cut's stage times sum to at least this
        best_val = objective_value(_stage_times(tables, cuts), num_microbatches, "alpa")
        for bound in np.unique(tables.time[np.isfinite(tables.time)]):
            if compute_total + (num_microbatches - 1) * bound >= best_val:
                break
            found = _dp(time, allowed & (time <= bound), "sum")
            if found is None:
                continue
            val = objective_value(_stage_times(tables, found[1]), num_microbatches, "alpa")
            if val < best_val:
                best_val, cuts = val, found[1]
    return evaluate_partition(costs, cuts, num_microbatches, objective, model)


def _stage_times(tables: _Tables, cuts: Sequence[int]) -> list[float]:
    return [float(tables.time[i, j]) for i, j in zip(cuts, cuts[1:], strict=False)]
