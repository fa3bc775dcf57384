"""Metric writers: where the `Trainer`'s records go. One small protocol, ``write(record)`` and ``close()``.

A record is a flat dict with a ``"step"`` key and JSON-friendly values (numbers, ``None`` for non-finite, lists).
`JsonlWriter` appends lines; `TensorBoardWriter` writes event files (``tensorboardX``, the ``[tensorboard]`` extra);
`WandbWriter` logs to Weights & Biases when ``wandb`` is installed. All write on process 0 only.

Example:
    >>> import tempfile, os
    >>> from openhosti_jax.train.writers import TensorBoardWriter, scalars
    >>> scalars({"step": 3, "loss": 2.5, "lr": None, "tag": "x", "sizes": [1, 2]})
    {'loss': 2.5}
    >>> logdir = tempfile.mkdtemp()
    >>> with TensorBoardWriter(logdir) as tb:
    ...     tb.write({"step": 1, "loss": 2.5})
    >>> any(name.startswith("events.out.tfevents") for name in os.listdir(logdir))
    True
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol, runtime_checkable

import jax

from openhosti_jax.errors import ConfigError
from openhosti_jax.train.metrics import MetricsLog

JsonlWriter = MetricsLog
"""The JSONL file writer (`openhosti_jax.train.metrics.MetricsLog`)."""


@runtime_checkable
class MetricWriter(Protocol):
    """Anything the `Trainer` can hand its records to."""

    def write(self, record: dict[str, Any]) -> None:
        """Take one record (a dict with ``"step"``)."""
        ...

    def close(self) -> None:
        """Flush and release."""
        ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric scalar entries of a record, without ``step`` (what a scalar dashboard can plot)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and v is not None
    }


def _optional(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"this metric writer needs the {module!r} package, which is not installed; "
            f"pip install 'openhosti_jax[{extra}]' (or pip install {module})"
        ) from e


class _Writer:
    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorBoardWriter(_Writer):
    """TensorBoard event files under ``logdir`` (one scalar per numeric metric, tagged by its name)."""

    def __init__(self, logdir: str | os.PathLike[str], *, flush_secs: int = 30) -> None:
        self.logdir = os.fspath(logdir)
        self._writer = None
        if jax.process_index() == 0:
            tbx = _optional("tensorboardX", "tensorboard")
            self._writer = tbx.SummaryWriter(self.logdir, flush_secs=flush_secs)

    def write(self, record: dict[str, Any]) -> None:
        """Add every numeric scalar of ``record`` at its ``step``."""
        if self._writer is not None:
            for name, value in scalars(record).items():
                self._writer.add_scalar(name, value, int(record["step"]))

    def close(self) -> None:
        """Flush the event file and close it."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbWriter(_Writer):
    """A Weights & Biases run; ``init`` keyword arguments go to ``wandb.init`` (e.g. ``project=``, ``mode=``)."""

    def __init__(self, **init: Any) -> None:
        self._run = None
        if jax.process_index() == 0:
            self._run = _optional("wandb", "wandb").init(**init)

    def write(self, record: dict[str, Any]) -> None:
        """Log the numeric scalars of ``record`` at its ``step``."""
        if self._run is not None:
            self._run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        """Finish the run."""
        if self._run is not None:
            self._run.finish()
            self._run = None
