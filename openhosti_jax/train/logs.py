"""`log_to_file`: library chatter (Python warnings, Orbax's absl lines, jax and this library's loggers) goes to
a log file in the run directory, so the terminal shows only the plan, the progress bar and the summary.

Example:
    >>> import logging, os, tempfile, warnings
    >>> from openhosti_jax.train.logs import log_to_file
    >>> path = os.path.join(tempfile.mkdtemp(), "log.txt")
    >>> with log_to_file(path):
    ...     warnings.warn("a library warning")
    ...     logging.getLogger("absl").warning("Skipping merge of OCDBT checkpoints")
    >>> text = open(path).read()
    >>> "a library warning" in text and "Skipping merge" in text
    True
"""

from __future__ import annotations

import logging
import os
from types import TracebackType

LOGGERS = ("py.warnings", "absl", "jax", "orbax", "openhosti_jax")
"""The loggers routed to the file (``py.warnings`` carries `warnings.warn` while routed)."""


class RoutedLogs:
    """The `LOGGERS` sent to ``path`` (appending) instead of the terminal, until `close` (or the ``with`` ends)."""

    def __init__(self, path: str | os.PathLike[str], level: int = logging.WARNING) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = os.fspath(path)
        self.handler = logging.FileHandler(self.path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._saved = [(name, logging.getLogger(name).propagate, logging.getLogger(name).level) for name in LOGGERS]
        logging.captureWarnings(True)
        for name in LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(self.handler)
            logger.propagate = False
            if logger.level == logging.NOTSET or logger.level > level:
                logger.setLevel(level)

    def close(self) -> None:
        """Give the loggers back their previous routing and close the file."""
        logging.captureWarnings(False)
        for name, propagate, level in self._saved:
            logger = logging.getLogger(name)
            logger.removeHandler(self.handler)
            logger.propagate = propagate
            logger.setLevel(level)
        self.handler.close()

    def __enter__(self) -> RoutedLogs:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def log_to_file(path: str | os.PathLike[str], level: int = logging.WARNING) -> RoutedLogs:
    """Route warnings and library loggers to ``path`` (see `RoutedLogs`)."""
    return RoutedLogs(path, level)
