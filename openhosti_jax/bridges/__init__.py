"""Bridges to PyTorch and TensorFlow: DLPack tensors, data loaders, weights and compute.

Neither framework is imported here; each is imported inside the function that needs it.
"""

from openhosti_jax.bridges.global_batch import default_batch_spec, to_global_batch
from openhosti_jax.bridges.tensors import (
    DeviceShard,
    shards_to_jax,
    shards_to_tf,
    shards_to_torch,
    to_jax,
    to_tf,
    to_torch,
    torch_to_numpy,
)
from openhosti_jax.bridges.torch_data import TorchLoader

__all__ = [
    "DeviceShard",
    "TorchLoader",
    "default_batch_spec",
    "shards_to_jax",
    "shards_to_tf",
    "shards_to_torch",
    "to_jax",
    "to_tf",
    "to_global_batch",
    "to_torch",
    "torch_to_numpy",
]
