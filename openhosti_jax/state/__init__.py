"""Sharded training state for Flax linen and nnx models."""

from openhosti_jax.state.train_state import TrainState

__all__ = ["TrainState"]
