"""Training state: `TrainState`, the one model intake, sharded init, and the core that jits a step under a plan."""

from openhosti_jax.state.contracts import ApplyFn, MeanLossFn, StepFn, SummedLossFn
from openhosti_jax.state.init import abstract_train_state, init_state, state_specs
from openhosti_jax.state.jit import jit_step, memory_bytes, memory_stats
from openhosti_jax.state.model import ModelParts, model_parts, nnx_apply_fn
from openhosti_jax.state.train_state import TrainState

__all__ = [
    "ApplyFn",
    "MeanLossFn",
    "ModelParts",
    "StepFn",
    "SummedLossFn",
    "TrainState",
    "abstract_train_state",
    "init_state",
    "jit_step",
    "memory_bytes",
    "memory_stats",
    "model_parts",
    "nnx_apply_fn",
    "state_specs",
]
