"""Sharded training state for Flax linen and nnx models."""

from openhosti_jax.state.create import abstract_train_state, create_train_state, nnx_apply_fn, resolve_plan
from openhosti_jax.state.train_state import TrainState

__all__ = ["TrainState", "abstract_train_state", "create_train_state", "nnx_apply_fn", "resolve_plan"]
