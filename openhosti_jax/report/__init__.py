"""Run reports: the run-directory layout, per-device memory records, and PNG figures (extra ``viz``)."""

from openhosti_jax.report.build import Report, summarize, write_report
from openhosti_jax.report.memory import compiled_memory, plan_record, predicted_memory, resident_memory
from openhosti_jax.report.rundir import RunData, append_jsonl, load_run, write_json

__all__ = [
    "Report",
    "RunData",
    "append_jsonl",
    "compiled_memory",
    "load_run",
    "plan_record",
    "predicted_memory",
    "resident_memory",
    "summarize",
    "write_json",
    "write_report",
]
