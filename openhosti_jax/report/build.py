"""`write_report`: every figure a run directory supports, as PNGs, plus ``report.json`` with the numbers.

Example:
    >>> import tempfile
    >>> from openhosti_jax.report.rundir import append_jsonl
    >>> from openhosti_jax.report.build import write_report
    >>> d = tempfile.mkdtemp()
    >>> for s, l in ((1, 2.0), (2, 1.0)):
    ...     append_jsonl(d, "metrics.jsonl", {"step": s, "loss": l, "tokens_per_s": 100.0 * s})
    >>> rep = write_report(d)
    >>> sorted(rep.figures), rep.summary["final_loss"]
    (['loss', 'throughput'], 1.0)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from typing import Any

from openhosti_jax.errors import MissingDataError
from openhosti_jax.report import figures
from openhosti_jax.report.rundir import RunData, load_run, write_json

REPORT_JSON = "report.json"


@dataclasses.dataclass(frozen=True)
class Report:
    """What `write_report` produced."""

    out_dir: str
    """Where the PNGs and ``report.json`` went."""
    figures: dict[str, str]
    """Figure name -> PNG path."""
    skipped: dict[str, str]
    """Figure name -> why it was skipped (missing data)."""
    summary: dict[str, Any]
    """Numbers read from the run (first / final / min loss, median throughput, ...)."""


def summarize(run: RunData) -> dict[str, Any]:
    """Headline numbers of a run; throughput medians leave out step 1 (it includes compilation)."""
    losses = [m["loss"] for m in run.metrics if isinstance(m.get("loss"), int | float)]
    later = [m for m in run.metrics if m.get("step", 0) > 1] or run.metrics
    tps = [m["tokens_per_s"] for m in later if isinstance(m.get("tokens_per_s"), int | float)]
    dts = [m["step_time_s"] for m in later if isinstance(m.get("step_time_s"), int | float)]
    out: dict[str, Any] = {
        "steps": len(run.metrics),
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "min_loss": min(losses) if losses else None,
        "median_tokens_per_s": statistics.median(tps) if tps else None,
        "median_step_time_s": statistics.median(dts) if dts else None,
    }
    if run.plan:
        out["mesh"] = run.plan.get("mesh")
        out["zero_stage"] = run.plan.get("zero_stage")
        out["compiled_peak_bytes"] = ((run.plan.get("memory") or {}).get("compiled") or {}).get("peak")
    if run.checkpoints:
        out["checkpoint_blocking_s_max"] = max(r["blocking_s"] for r in run.checkpoints)
    return out


def write_report(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, schedule: dict[str, Any] | None = None
) -> Report:
    """Write the PNGs a run supports into ``out_dir`` (default ``run_dir/report``) and ``report.json``.

    ``schedule`` (same keys as ``schedule.json``) is simulated when the run recorded no schedule.
    """
    run = load_run(run_dir)
    out = os.fspath(out_dir) if out_dir is not None else os.path.join(run.path, "report")
    os.makedirs(out, exist_ok=True)
    makers: dict[str, Callable[[], Any]] = {
        "loss": lambda: figures.loss_figure(run.metrics),
        "throughput": lambda: figures.throughput_figure(run.metrics),
        "memory": lambda: figures.memory_figure(run.plan),
        "pipeline": lambda: figures.pipeline_figure(run.schedule or schedule),
        "balance": lambda: figures.balance_figure(run.balance or figures.balance_records(run.metrics)),
        "checkpoints": lambda: figures.checkpoint_figure(run.checkpoints),
        "experts": lambda: figures.experts_figure(run.metrics),
    }
    written, skipped = {}, {}
    for name, make in makers.items():
        try:
            fig = make()
        except MissingDataError as e:
            skipped[name] = str(e)
            continue
        path = os.path.join(out, f"{name}.png")
        fig.savefig(path, dpi=figures.DPI)
        written[name] = path
    summary = summarize(run)
    write_json(out, REPORT_JSON, {"summary": summary, "figures": written, "skipped": skipped})
    return Report(out, written, skipped, summary)
