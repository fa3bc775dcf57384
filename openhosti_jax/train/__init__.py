"""Training on top of the core: ``@spmd``, `balanced_step`, `create_train_state`, `pipeline_step` and the `Trainer`
loop."""

from openhosti_jax.train.balanced import BalancedStep, balanced_step
from openhosti_jax.train.create import CreatedState, PlanChoice, create_train_state
from openhosti_jax.train.metrics import MetricsLog, read_metrics
from openhosti_jax.train.pipelined import from_model_state, pipeline_step, to_model_state
from openhosti_jax.train.profiling import ProfileWindow
from openhosti_jax.train.resume import TrainerCheckpoint
from openhosti_jax.train.spikes import LossSpikePolicy
from openhosti_jax.train.spmd_step import SpmdStep, spmd
from openhosti_jax.train.trainer import FitResult, Trainer
from openhosti_jax.train.writers import JsonlWriter, MetricWriter, TensorBoardWriter, WandbWriter

__all__ = [
    "BalancedStep",
    "CreatedState",
    "FitResult",
    "JsonlWriter",
    "LossSpikePolicy",
    "MetricWriter",
    "MetricsLog",
    "PlanChoice",
    "ProfileWindow",
    "SpmdStep",
    "TensorBoardWriter",
    "Trainer",
    "TrainerCheckpoint",
    "WandbWriter",
    "balanced_step",
    "create_train_state",
    "pipeline_step",
    "from_model_state",
    "read_metrics",
    "spmd",
    "to_model_state",
]
