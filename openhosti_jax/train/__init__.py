"""The ``@spmd`` step decorator and the `Trainer` loop."""

from openhosti_jax.train.step import SpmdStep, shard_batch, spmd

__all__ = ["SpmdStep", "shard_batch", "spmd"]
