"""Torch ``state_dict`` <-> Flax params by a per-layer name mapping, with each layer kind's layout change.

=========== ========================= ======================================
kind        torch                     flax (linen ``nn.*`` / ``nnx.*``)
=========== ========================= ======================================
linear      weight (out, in), bias    kernel (in, out), bias
conv        weight (O, I, *K), bias   kernel (*K, I, O), bias  (Conv1d/2d/3d)
embedding   weight (num, dim)         embedding (num, dim)
layernorm   weight, bias              scale, bias
=========== ========================= ======================================

`layer_maps` reads the kinds off a torch module and names the Flax path of each layer (by default the torch
name split on ``.``, so name the Flax submodules like the torch ones or pass ``name_map``). Then
`torch_to_flax` / `flax_to_torch` convert; both refuse (all problems at once) keys nobody maps.

Example:
    >>> import torch, numpy as np
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> maps = layer_maps(net, {"0": "Dense_0"})
    >>> params = torch_to_flax(net.state_dict(), maps)
    >>> params["Dense_0"]["kernel"].shape
    (3, 2)
    >>> sd = flax_to_torch(params, maps)
    >>> bool(torch.equal(sd["0.weight"], net.state_dict()["0.weight"]))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from openhosti_jax.bridges.tensors import torch_to_numpy
from openhosti_jax.errors import BridgeError

LayerKind = Literal["linear", "conv", "embedding", "layernorm"]
NameMap = Mapping[str, str | tuple[str, ...]] | Callable[[str], tuple[str, ...]]
# torch parameter name -> flax parameter name, per kind
_PARAM_NAMES: dict[str, dict[str, str]] = {
    "linear": {"weight": "kernel", "bias": "bias"},
    "conv": {"weight": "kernel", "bias": "bias"},
    "embedding": {"weight": "embedding"},
    "layernorm": {"weight": "scale", "bias": "bias"},
}


@dataclass(frozen=True)
class LayerMap:
    """Where one torch layer's parameters go in the Flax params tree.

    Attributes:
        torch_name: the module's prefix in the ``state_dict`` (``"blocks.0.fc"``; ``""`` for the root).
        flax_path: the Flax module's path in the params tree (``("blocks_0", "fc")``).
        kind: ``"linear"``, ``"conv"``, ``"embedding"`` or ``"layernorm"``.
    """

    torch_name: str
    flax_path: tuple[str, ...]
    kind: LayerKind

    def __post_init__(self) -> None:
        if self.kind not in _PARAM_NAMES:
            raise BridgeError(
                f"LayerMap {self.torch_name!r}: expected kind in {sorted(_PARAM_NAMES)}, found {self.kind!r}"
            )
        if not self.flax_path or not all(isinstance(p, str) and p for p in self.flax_path):
            raise BridgeError(
                f"LayerMap {self.torch_name!r}: expected a non-empty tuple of names as flax_path, "
                f"found {self.flax_path!r}"
            )

    def key(self, param: str) -> str:
        """The ``state_dict`` key of this layer's torch parameter ``param``."""
        return f"{self.torch_name}.{param}" if self.torch_name else param


def _kind(module: Any) -> LayerKind | None:
    from torch import nn

    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        return "conv"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    return None


def _flax_path(name: str, name_map: NameMap | None) -> tuple[str, ...] | None:
    if name_map is None:
        return tuple(name.split(".")) if name else None
    if callable(name_map):
        return tuple(name_map(name))
    found = name_map.get(name)
    return None if found is None else (tuple(found.split("/")) if isinstance(found, str) else tuple(found))


def layer_maps(module: Any, name_map: NameMap | None = None) -> tuple[LayerMap, ...]:
    """One `LayerMap` per parameterised layer of a ``torch.nn.Module``.

    Args:
        module: the torch model.
        name_map: torch module name -> Flax path (``"a/b"`` or a tuple), as a dict or a function; default:
            the torch name split on ``.``.
    """
    maps, problems = [], []
    for name, sub in module.named_modules():
        own = [p for p, _ in sub.named_parameters(recurse=False)]
        if not own:
            continue
        kind, path = _kind(sub), _flax_path(name, name_map)
        if kind is None:
            problems.append(
                f"{name or '<root>'}: a {type(sub).__name__} with parameters {own}; supported layers are "
                "Linear, Conv1d/2d/3d, Embedding, LayerNorm; convert it by hand and drop its keys"
            )
        elif path is None:
            problems.append(f"{name or '<root>'}: no Flax path in name_map; add {name!r}: 'FlaxName'")
        else:
            maps.append(LayerMap(name, path, kind))
    if problems:
        raise BridgeError("layer_maps: cannot map every layer:\n" + "\n".join(problems))
    return tuple(maps)


def _torch_layout_to_flax(kind: str, param: str, x: np.ndarray) -> np.ndarray:
    if param != "weight" or kind in ("embedding", "layernorm"):
        return x
    if kind == "linear":
        return x.T
    return np.transpose(x, (*range(2, x.ndim), 1, 0))


def _flax_layout_to_torch(kind: str, param: str, x: np.ndarray) -> np.ndarray:
    if param != "weight" or kind in ("embedding", "layernorm"):
        return x
    if kind == "linear":
        return x.T
    return np.transpose(x, (x.ndim - 1, x.ndim - 2, *range(x.ndim - 2)))


def torch_to_flax(state_dict: Mapping[str, Any], layers: tuple[LayerMap, ...]) -> dict[str, Any]:
    """The Flax params tree (nested dicts of numpy arrays) for a torch ``state_dict``.

    Pass the result as ``{"params": tree}`` to a linen ``apply``; place it with a sharding as you would any
    host arrays. Every ``state_dict`` entry must belong to a mapped layer (buffers such as BatchNorm running
    statistics are refused by name).
    """
    tree: dict[str, Any] = {}
    used, problems = set(), []
    for layer in layers:
        node = tree
        for part in layer.flax_path:
            node = node.setdefault(part, {})
        for param, flax_name in _PARAM_NAMES[layer.kind].items():
            key = layer.key(param)
            if key not in state_dict:
                if param == "weight":
                    problems.append(f"{key}: missing from the state_dict (layer {layer.torch_name!r})")
                continue
            used.add(key)
            value = torch_to_numpy(state_dict[key])
            node[flax_name] = np.ascontiguousarray(_torch_layout_to_flax(layer.kind, param, value))
    extra = sorted(set(state_dict) - used)
    if extra:
        problems.append(f"state_dict keys no LayerMap covers: {extra}; add layers for them or drop them")
    if problems:
        raise BridgeError("torch_to_flax:\n" + "\n".join(problems))
    return tree


def _numpy_to_torch(x: np.ndarray) -> Any:
    import torch

    x = np.array(x, order="C", copy=True)  # the state_dict owns its memory (jax buffers are read-only)
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def flax_to_torch(params: Mapping[str, Any], layers: tuple[LayerMap, ...]) -> dict[str, Any]:
    """A torch ``state_dict`` (``str -> torch.Tensor``) from a Flax params tree; inverse of `torch_to_flax`.

    ``params`` leaves may be numpy or (sharded, fully addressable) ``jax.Array``s; the result loads with
    ``module.load_state_dict(sd)``.
    """
    out, problems = {}, []
    for layer in layers:
        node: Any = params
        for part in layer.flax_path:
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is None:
            problems.append(f"{'/'.join(layer.flax_path)}: missing from the params (layer {layer.torch_name!r})")
            continue
        for param, flax_name in _PARAM_NAMES[layer.kind].items():
            if flax_name in node:
                value = _flax_layout_to_torch(layer.kind, param, np.asarray(node[flax_name]))
                out[layer.key(param)] = _numpy_to_torch(value)
    if problems:
        raise BridgeError("flax_to_torch:\n" + "\n".join(problems))
    return out


__all__ = ["LayerKind", "LayerMap", "flax_to_torch", "layer_maps", "torch_to_flax"]
