"""Metrics: a JSONL log written by process 0 only, and throughput bookkeeping.

Example:
    >>> import tempfile, os, json
    >>> from openhosti_jax.train.metrics import MetricsLog
    >>> path = os.path.join(tempfile.mkdtemp(), "m.jsonl")
    >>> with MetricsLog(path) as log:
    ...     log.write({"step": 1, "loss": 2.5})
    >>> json.loads(open(path).read())
    {'step': 1, 'loss': 2.5}
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import numpy as np


def to_python(value: Any) -> Any:
    """A JSON-friendly copy of a metric value (arrays -> floats / lists, NaN -> None)."""
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_python(v) for v in value]
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        arr = np.asarray(value)
        value = arr.item() if arr.ndim == 0 else arr.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Append-only JSONL metrics file; a no-op on every process but 0 (``path=None`` disables it)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = os.fspath(path) if path is not None else None
        self._file = None
        if self.path is not None and jax.process_index() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        """Write one record (one line)."""
        if self._file is not None:
            self._file.write(json.dumps(to_python(record)) + "\n")

    def close(self) -> None:
        """Flush and close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a JSONL metrics file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
