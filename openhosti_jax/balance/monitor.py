"""`Monitor`: smoothed per-device (and per-host) seconds per microbatch from the balanced step's probes.

Every ``every`` steps the balanced step runs as a probe (`BalancedGradFn.probe`), which times each device's
local phase. ``observe`` divides by the device's count to get seconds per microbatch; with several processes
the per-device times are exchanged with `multihost_utils.process_allgather`, so every process holds the same
numbers. Each device keeps its last ``window`` raw samples: the median of those (one noisy sample cannot move
it) feeds an exponential moving average with weight ``alpha``.
Example:
    >>> import numpy as np
    >>> from openhosti_jax.balance import Monitor
    >>> m = Monitor(size=2, every=1, alpha=1.0)
    >>> for s in ([1.0, 2.0], [1.0, 2.0], [9.0, 2.0]):  # one noisy sample on device 0
    ...     m.observe(np.array(s), counts=(2, 2))
    >>> m.seconds_per_microbatch.tolist()
    [0.5, 1.0]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from openhosti_jax.errors import BalanceError


class Monitor:
    """Per-device seconds per microbatch (EWMA over a sliding median), identical on every process."""

    def __init__(self, size: int, *, every: int = 10, alpha: float = 0.5, window: int = 3):
        problems = []
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            problems.append(f"size={size!r} (expected the data-axis size, an int >= 1)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            problems.append(f"every={every!r} (expected an int >= 1: probe every that many steps)")
        if not 0.0 < alpha <= 1.0:
            problems.append(f"alpha={alpha!r} (expected 0 < alpha <= 1)")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            problems.append(f"window={window!r} (expected an int >= 1; 3 rejects one outlier)")
        if problems:
            raise BalanceError("invalid Monitor: " + "; ".join(problems))
        self.size, self.every, self.alpha = size, every, alpha
        self._recent = [deque(maxlen=window) for _ in range(size)]
        self._ewma = np.full(size, np.nan)
        self.last_seconds = np.full(size, np.nan)
        """The last probe's local-phase seconds per device (all processes' devices)."""

    def should_probe(self, step: int) -> bool:
        """Whether step number ``step`` should run as a timed probe (the first step always does)."""
        return step % self.every == 0

    def observe(self, seconds: np.ndarray, counts: Sequence[int]) -> None:
        """Record one probe: ``seconds[i]`` (NaN where another process owns device i) for ``counts[i]``."""
        seconds = np.asarray(seconds, np.float64)
        counts = np.asarray(counts)
        if seconds.shape != (self.size,) or counts.shape != (self.size,):
            raise BalanceError(
                f"expected {self.size} seconds and counts (one per data-parallel device), found shapes "
                f"{seconds.shape} and {counts.shape}"
            )
        if jax.process_count() > 1:
            seconds = np.nanmax(np.asarray(multihost_utils.process_allgather(seconds)), axis=0)
        self.last_seconds = seconds
        for i in range(self.size):
            if counts[i] > 0 and np.isfinite(seconds[i]):
                self._recent[i].append(seconds[i] / counts[i])
                sample = float(np.median(self._recent[i]))
                old = self._ewma[i]
                self._ewma[i] = sample if np.isnan(old) else (1 - self.alpha) * old + self.alpha * sample

    def forget(self, device: int) -> None:
        """Drop device ``device``'s samples (stale after it ran no work): its next probe alone sets its speed."""
        self._recent[device].clear()
        self._ewma[device] = np.nan

    @property
    def seconds_per_microbatch(self) -> np.ndarray:
        """Smoothed seconds per microbatch per device (NaN before a device's first sample)."""
        return self._ewma.copy()

    @property
    def ready(self) -> bool:
        """True once every device has at least one sample."""
        return bool(np.isfinite(self._ewma).all())

    def speeds(self) -> np.ndarray:
        """Microbatches per second per device; `BalanceError` before every device has been measured."""
        if not self.ready:
            raise BalanceError(
                f"expected a measurement for every device, missing {np.flatnonzero(~np.isfinite(self._ewma))}"
                "; "
                "run a probe step (BalancedGradFn.probe) and observe() it first"
            )
        return 1.0 / self._ewma

    def host_seconds(self, owners: Sequence[int]) -> dict[int, float]:
        """Per process: its slowest device's last local-phase seconds (``owners[i]``: device i's process)."""
        out: dict[int, float] = {}
        for p, t in zip(owners, self.last_seconds, strict=True):
            out[int(p)] = max(out.get(int(p), -np.inf), float(t))
        return out
