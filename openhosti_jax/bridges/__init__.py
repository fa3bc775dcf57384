"""Bridges to PyTorch and TensorFlow: DLPack tensors, data loaders, weights and compute.

Neither framework is imported here; each is imported inside the function that needs it.
"""

from openhosti_jax.bridges.tensors import (
    DeviceShard,
    shards_to_jax,
    shards_to_tf,
    shards_to_torch,
    to_jax,
    to_tf,
    to_torch,
)

__all__ = [
    "DeviceShard",
    "shards_to_jax",
    "shards_to_tf",
    "shards_to_torch",
    "to_jax",
    "to_tf",
    "to_torch",
]
