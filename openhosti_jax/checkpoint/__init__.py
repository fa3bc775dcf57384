"""Checkpoints: async Orbax saves on a schedule and on preemption, checksums of every file (each process those
it wrote), restore onto any mesh that tells a changed model (`CheckpointMismatchError`) from damaged files
(`CheckpointCorruptError`), replication to a second location, and a supervisor that restarts a crashed run."""

from openhosti_jax.checkpoint.faults import CheckpointWarning, FailurePolicy
from openhosti_jax.checkpoint.manager import CheckpointManager
from openhosti_jax.checkpoint.policy import SavePolicy
from openhosti_jax.checkpoint.restart import RESTART_ENV, run_with_restarts

__all__ = ["RESTART_ENV", "CheckpointManager", "CheckpointWarning", "FailurePolicy", "SavePolicy", "run_with_restarts"]
