r"""`PlanReport`: why a `ShardingPlan` was chosen and what happened to it, kept apart from the decision itself.

The planner fills in its predictions, the AOT-compiled bytes and the ranked candidates (as data); a running step
records events such as an out-of-memory resize. Printing a report prints the plan's table, then the provenance.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.sharding.plan import ShardingPlan
    >>> from openhosti_jax.sharding.report import CandidateRow, PlanReport
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
    >>> plan = ShardingPlan.from_zero(params, optax.sgd(0.1), {"fsdp": 8}, 3)
    >>> report = PlanReport(plan, params, predicted_bytes=2**16, compiled_bytes=2**16,
    ...                     candidates=(CandidateRow("fsdp=8 zero3", 1e-3, 2**16, 2**18),))
    >>> report.record("RESOURCE_EXHAUSTED at microbatch 8: now 4")
    >>> print(*str(report).splitlines()[-6:], sep="\n")
      memory/device   predicted 64.00 KiB, compiled 64.00 KiB (ratio 1.00)
      comm/step       - sent per device
      candidates (best first):
        fsdp=8 zero3                          1.00 ms     64.00 KiB  comm   256.00 KiB
      events:
        RESOURCE_EXHAUSTED at microbatch 8: now 4
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.table import format_bytes


@dataclasses.dataclass(frozen=True)
class CandidateRow:
    """One candidate the planner scored: its label and predictions."""

    label: str
    """Mesh axes and ZeRO stage, e.g. ``"data=2 fsdp=4 zero1"``."""
    seconds: float
    """Predicted seconds per step."""
    bytes: int
    """Predicted bytes per device."""
    comm_bytes: float
    """Predicted bytes sent per device per step by collectives."""

    def __str__(self) -> str:
        return (
            f"{self.label:<32} {self.seconds * 1e3:9.2f} ms  {format_bytes(self.bytes):>12}"
            f"  comm {format_bytes(self.comm_bytes):>12}"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class PlanReport:
    """The provenance of ``plan``: predictions, compiled bytes, ranked candidates, reasons and run-time events."""

    plan: ShardingPlan
    """The decision this report explains."""
    param_shapes: Any = None
    """The abstract parameter tree the plan was made for (the table shows shapes and the largest leaves)."""
    predicted_bytes: int | None = None
    """Cost model's per-device memory (state + activations), if a cost model was run."""
    predicted_seconds: float | None = None
    """Cost model's step time, if a cost model was run."""
    predicted_comm_bytes: int | None = None
    """Cost model's bytes sent per device per step by collectives."""
    predicted_parts: Mapping[str, Mapping[str, float]] | None = None
    """Cost model's parts: ``{"time": {"compute": s, ...}, "memory": {"state": bytes, ...}}``."""
    compiled_bytes: int | None = None
    """Per-device bytes of the AOT-compiled step's `memory_analysis()`, if it was compiled."""
    candidates: tuple[CandidateRow, ...] = ()
    """The search's ranking, best first."""
    notes: tuple[str, ...] = ()
    """Why this plan was chosen, one line each."""
    events: list[str] = dataclasses.field(default_factory=list)
    """What happened while the plan ran (an out-of-memory resize, an automatic microbatch), in order."""

    def record(self, event: str) -> None:
        """Append a run-time event."""
        self.events.append(event)

    def __str__(self) -> str:
        ratio = (
            f" (ratio {self.predicted_bytes / self.compiled_bytes:.2f})"
            if self.predicted_bytes and self.compiled_bytes
            else ""
        )
        step = f", predicted step {self.predicted_seconds * 1e3:.2f} ms" if self.predicted_seconds is not None else ""
        lines = [
            self.plan.table(self.param_shapes),
            f"  memory/device   predicted {format_bytes(self.predicted_bytes)}, "
            f"compiled {format_bytes(self.compiled_bytes)}{ratio}",
            f"  comm/step       {format_bytes(self.predicted_comm_bytes)} sent per device{step}",
        ]
        if self.candidates:
            lines += ["  candidates (best first):", *[f"    {c}" for c in self.candidates[:8]]]
        if self.notes:
            lines += ["  why:", *[f"    {n}" for n in self.notes]]
        if self.events:
            lines += ["  events:", *[f"    {e}" for e in self.events]]
        return "\n".join(lines)
