"""`SavePolicy`: when a checkpoint is due (every N minutes, every K steps) and how many to keep.

Example:
    >>> from openhosti_jax.checkpoint.policy import SavePolicy
    >>> p = SavePolicy(every_minutes=None, every_steps=10)
    >>> p.due(step=20, seconds_since_save=0.0), p.due(step=21, seconds_since_save=1e9)
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

from openhosti_jax.errors import ConfigError


@dataclass(frozen=True)
class SavePolicy:
    """When `CheckpointManager.maybe_save` writes a step."""

    every_minutes: float | None = 15.0
    """Save when this many minutes passed since the last save (or the start); ``None``: never by time."""
    every_steps: int | None = None
    """Save every step divisible by this; ``None``: never by step count."""
    keep: int | None = 3
    """Keep the newest this many steps (older ones are deleted); ``None``: keep all."""

    def __post_init__(self) -> None:
        if self.every_minutes is not None and not self.every_minutes > 0:
            raise ConfigError(f"expected every_minutes > 0 or None, found {self.every_minutes}")
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps < 1):
            raise ConfigError(f"expected every_steps to be an int >= 1 or None, found {self.every_steps!r}")
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            raise ConfigError(
                f"expected keep to be an int >= 1 or None (keep all), found {self.keep!r}; keep=1 keeps only "
                "the newest step, which leaves nothing to fall back to if it is corrupt"
            )

    def due(self, step: int, seconds_since_save: float) -> bool:
        """Whether ``step`` should be saved, ``seconds_since_save`` after the previous save."""
        return self.due_by_steps(step) or self.due_by_time(seconds_since_save)

    def due_by_steps(self, step: int) -> bool:
        """Whether the step count asks for a save of ``step``."""
        return self.every_steps is not None and step % self.every_steps == 0

    def due_by_time(self, seconds_since_save: float) -> bool:
        """Whether the clock asks for a save, ``seconds_since_save`` after the previous one."""
        return self.every_minutes is not None and seconds_since_save >= 60.0 * self.every_minutes
