"""The run directory: what ``openhosti train --run-dir DIR`` writes and ``openhosti report DIR`` reads.

Layout (every file but ``metrics.jsonl`` is optional; a figure whose data is missing is skipped)::

    DIR/metrics.jsonl      one Trainer record per step: step, loss, step_time_s, tokens_per_s, ... (a balanced
                           step adds counts and device_speeds, which the balance figure plots)
    DIR/plan.txt           the printed ShardingPlan
    DIR/plan.json          mesh, zero_stage, num_microbatches, pipeline_stages, predicted/compiled bytes and
                           the memory breakdown {"predicted": {...}, "compiled": {...}, "per_device": [...]}
    DIR/schedule.json      a pipeline schedule: {"kind", "num_stages", "num_microbatches", "num_virtual",
                           "forward_times", "backward_times", "comm_time"}
    DIR/balance.jsonl      balancer assignments: {"step": int, "counts": [microbatches per device]}
    DIR/checkpoints.jsonl  checkpoint calls: {"step": int, "blocking_s": float}
    DIR/log.txt            warnings and library log lines of the run (kept off the terminal)
    DIR/tensorboard/       TensorBoard events (``--tensorboard``); DIR/profile/ a jax.profiler trace

Example:
    >>> import tempfile
    >>> from openhosti_jax.report.rundir import append_jsonl, load_run
    >>> d = tempfile.mkdtemp()
    >>> append_jsonl(d, "metrics.jsonl", {"step": 1, "loss": 2.0})
    >>> load_run(d).metrics
    [{'step': 1, 'loss': 2.0}]
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from openhosti_jax.errors import ReportError

METRICS = "metrics.jsonl"
PLAN_TXT = "plan.txt"
PLAN_JSON = "plan.json"
SCHEDULE = "schedule.json"
BALANCE = "balance.jsonl"
CHECKPOINTS = "checkpoints.jsonl"
LOG = "log.txt"


@dataclasses.dataclass(frozen=True)
class RunData:
    """Everything a run directory recorded (``None`` / empty where a file is absent)."""

    path: str
    """The run directory."""
    metrics: list[dict[str, Any]]
    """Per-step Trainer records."""
    plan: dict[str, Any] | None = None
    """``plan.json``."""
    plan_text: str | None = None
    """``plan.txt``."""
    schedule: dict[str, Any] | None = None
    """``schedule.json``."""
    balance: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``balance.jsonl`` records."""
    checkpoints: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``checkpoints.jsonl`` records."""


def write_json(run_dir: str | os.PathLike, name: str, obj: Any) -> str:
    """Write ``obj`` as ``run_dir/name`` (indented JSON); return the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    return path


def append_jsonl(run_dir: str | os.PathLike, name: str, record: dict[str, Any]) -> None:
    """Append one JSON line to ``run_dir/name``."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, name), "a") as f:
        f.write(json.dumps(record) + "\n")


_NUMBERS = ("step", "batch", "loss", "step_time_s", "tokens_per_s", "lr", "skipped_total", "blocking_s")
"""Fields the figures read as numbers: a record with anything else there was not written by a run."""


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every record of a JSONL file, each a JSON object whose `_NUMBERS` fields are numbers (or null);
    `ReportError` naming the line of one that is not."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                record = e
            wrong = [
                k
                for k in _NUMBERS
                if isinstance(record, dict)
                and record.get(k) is not None
                and (isinstance(record[k], bool) or not isinstance(record[k], int | float))
            ]
            if not isinstance(record, dict) or wrong:
                raise ReportError(
                    f"expected one JSON object per line in {path} (numbers in {', '.join(wrong) or 'its fields'}), "
                    f"found at line {n}: {line.strip()[:120]!r}; "
                    "fix or remove that line (a run cut short can leave half a line at the end)"
                )
            records.append(record)
    return records


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        return None
    try:
        with open(path, errors="replace") as f:
            return json.load(f)
    except ValueError as e:
        raise ReportError(f"expected JSON in {path}, found {e}; write it again (`openhosti train --run-dir`)") from e


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Read a run directory; `ReportError` if it does not exist or has no ``metrics.jsonl``."""
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise ReportError(
            f"expected a run directory, found no directory at {run_dir!r}; pass the --run-dir used by `openhosti train`"
        )
    metrics_path = os.path.join(run_dir, METRICS)
    if not os.path.exists(metrics_path):
        raise ReportError(
            f"expected {METRICS} in {run_dir!r}, found {sorted(os.listdir(run_dir))}; train with "
            f"`openhosti train --run-dir {run_dir}` first"
        )
    text_path = os.path.join(run_dir, PLAN_TXT)
    plan_text = open(text_path).read() if os.path.exists(text_path) else None  # noqa: SIM115
    return RunData(
        path=run_dir,
        metrics=_read_jsonl(metrics_path),
        plan=_read_json(os.path.join(run_dir, PLAN_JSON)),
        plan_text=plan_text,
        schedule=_read_json(os.path.join(run_dir, SCHEDULE)),
        balance=_read_jsonl(os.path.join(run_dir, BALANCE)),
        checkpoints=_read_jsonl(os.path.join(run_dir, CHECKPOINTS)),
    )
