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
    torch_to_numpy,
)
from openhosti_jax.bridges.tf_compute import wrap_for_tf
from openhosti_jax.bridges.tf_data import TFDatasetLoader
from openhosti_jax.bridges.torch_compute import wrap_for_torch
from openhosti_jax.bridges.torch_data import PermutationBatchSampler, TorchLoader
from openhosti_jax.bridges.weights import LayerMap, flax_to_torch, layer_maps, torch_to_flax

__all__ = [
    "DeviceShard",
    "LayerMap",
    "PermutationBatchSampler",
    "TFDatasetLoader",
    "TorchLoader",
    "flax_to_torch",
    "layer_maps",
    "shards_to_jax",
    "shards_to_tf",
    "shards_to_torch",
    "to_jax",
    "to_tf",
    "torch_to_flax",
    "to_torch",
    "torch_to_numpy",
    "wrap_for_tf",
    "wrap_for_torch",
]
