"""`ProfileWindow`: a ``jax.profiler`` trace of a chosen window of steps (``--profile-steps 10:15``).

The trace starts before step ``first`` is dispatched and stops once step ``last`` has finished on the device, so
the window holds exactly those steps; it is written under ``logdir`` (TensorBoard's profile plugin or Perfetto
read it). Only process 0 traces.

Example:
    >>> from openhosti_jax.train.profiling import ProfileWindow
    >>> ProfileWindow.parse("10:15", "runs/x/profile")
    ProfileWindow(first=10, last=15, logdir='runs/x/profile')
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from openhosti_jax.errors import ConfigError


@dataclasses.dataclass
class ProfileWindow:
    """Trace steps ``first``..``last`` (1-based optimizer steps, inclusive) into ``logdir``."""

    first: int
    last: int
    logdir: str
    active: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.first <= self.last:
            raise ConfigError(
                f"expected profile steps 1 <= first <= last, found {self.first}:{self.last}; e.g. '10:15'"
            )

    @classmethod
    def parse(cls, text: str, logdir: str) -> ProfileWindow:
        """From ``"first:last"`` (or one step ``"12"``)."""
        parts = text.split(":")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ConfigError(f"expected --profile-steps FIRST:LAST (e.g. 10:15), found {text!r}")
        first, last = int(parts[0]), int(parts[-1])
        return cls(first, last, logdir)

    def before(self, step: int) -> None:
        """Call before dispatching optimizer step ``step``: starts the trace at ``first``."""
        if step == self.first and not self.active and jax.process_index() == 0:
            jax.profiler.start_trace(self.logdir)
            self.active = True

    def after(self, step: int, state: Any) -> None:
        """Call after dispatching step ``step`` (its output ``state``): stops the trace once ``last`` is done."""
        if self.active and step >= self.last:
            self.stop(state)

    def stop(self, state: Any = None) -> None:
        """Wait for ``state`` on the device and end the trace (a no-op when no trace runs)."""
        if self.active:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False
