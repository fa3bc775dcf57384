"""`LossSpikePolicy`: when a loss is a spike, as a policy object the `Trainer` consults.

A loss is a spike when it lies more than ``z`` standard deviations above the mean of the last ``window`` good
losses (at least ``min_history`` of them; a non-finite loss is handled by the step's non-finite guard, not here).
The `Trainer` then rolls back to its last good checkpoint and skips the batch that caused the spike and the
``skip_batches - 1`` batches before it, as PaLM did (Chowdhery et al. 2022, section 5.1: restart about 100 steps
before the spike and skip 200-500 batches).

Example:
    >>> from openhosti_jax.train.spikes import LossSpikePolicy
    >>> policy = LossSpikePolicy(z=4.0, window=8, min_history=4)
    >>> watch = policy.watch()
    >>> [watch.check(i, loss) is not None for i, loss in enumerate([2.0, 1.9, 2.1, 2.0, 1.95, 9.0], start=1)]
    [False, False, False, False, False, True]
    >>> watch.forget_after(3)
    >>> len(watch.history)
    3
"""

from __future__ import annotations

import collections
import dataclasses
import math

from openhosti_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LossSpikePolicy:
    """Spike detection and what to skip. ``z``: threshold in standard deviations; ``window``: good losses kept;
    ``min_history``: losses needed before anything counts as a spike; ``skip_batches``: batches skipped per
    spike, ending with the one that spiked; ``max_rollbacks``: rollbacks per run before the run stops with an
    error (a run that keeps spiking needs a person)."""

    z: float = 6.0
    window: int = 100
    min_history: int = 20
    skip_batches: int = 1
    max_rollbacks: int = 10

    def __post_init__(self) -> None:
        if not (self.z > 0 and self.window >= 2 and 2 <= self.min_history <= self.window):
            raise ConfigError(
                f"LossSpikePolicy: expected z > 0 and 2 <= min_history <= window, found z={self.z}, "
                f"window={self.window}, min_history={self.min_history}"
            )
        if self.skip_batches < 1 or self.max_rollbacks < 1:
            raise ConfigError(
                f"LossSpikePolicy: expected skip_batches >= 1 and max_rollbacks >= 1, found {self.skip_batches}, "
                f"{self.max_rollbacks}"
            )

    def watch(self) -> SpikeWatch:
        """A fresh detector for one run."""
        return SpikeWatch(self)


class SpikeWatch:
    """The running window of one run: `check` each loss with its batch number; `forget_after` on a rollback."""

    def __init__(self, policy: LossSpikePolicy) -> None:
        self.policy = policy
        self.history: collections.deque[tuple[int, float]] = collections.deque(maxlen=policy.window)

    def check(self, batch: int, loss: float) -> float | None:
        """The z-score when ``loss`` (of batch number ``batch``) is a spike, else None (and the loss joins the
        window). Non-finite losses are neither spikes nor history."""
        if not math.isfinite(loss):
            return None
        if len(self.history) >= self.policy.min_history:
            values = [v for _, v in self.history]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
            score = (loss - mean) / max(std, 1e-12 * max(abs(mean), 1.0))
            if score > self.policy.z:
                return score
        self.history.append((batch, loss))
        return None

    def forget_after(self, batch: int) -> None:
        """Drop the losses of batches after ``batch`` (they are trained again after a rollback)."""
        kept = [(b, v) for b, v in self.history if b <= batch]
        self.history.clear()
        self.history.extend(kept)
