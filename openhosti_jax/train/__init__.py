"""The ``@spmd`` step decorator and the `Trainer` loop."""

from openhosti_jax.train.metrics import MetricsLog, read_metrics
from openhosti_jax.train.resume import TrainerCheckpoint
from openhosti_jax.train.step import SpmdStep, shard_batch, spmd
from openhosti_jax.train.trainer import FitResult, Trainer

__all__ = ["FitResult", "MetricsLog", "SpmdStep", "Trainer", "TrainerCheckpoint", "read_metrics", "shard_batch", "spmd"]
