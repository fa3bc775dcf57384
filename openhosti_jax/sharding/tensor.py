"""Tensor-parallel specs for unannotated attention / MLP weights, Megatron style: column- then row-parallel.

A column-parallel layer (attention q/k/v, MLP up/gate, output head) splits its output features over ``tensor``;
the following row-parallel layer (attention output, MLP down) splits its input features, so each block needs one
all-reduce forward (and one backward). Layers are recognised by their pytree path (the module name just above
``kernel``/``bias``/``embedding``); each gets logical names that `rules.logical_spec` maps to mesh axes, so user
rules apply to them too. Annotated leaves (Flax metadata) keep their own names.

Example:
    >>> from openhosti_jax.sharding.tensor import tensor_names
    >>> tensor_names("['blocks'][0]['fc']['kernel']", (64, 256))
    ('embed', 'mlp')
    >>> tensor_names("['blocks'][0]['out']['kernel']", (256, 64))
    ('mlp', 'embed')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from openhosti_jax.sharding.rules import DEFAULT_RULES, LAYER_AXIS, Rules, logical_names, logical_spec, validate_rules

COLUMN = (
    "qkv",
    "query",
    "key",
    "value",
    "q_proj",
    "k_proj",
    "v_proj",
    "c_attn",
    "fc",
    "fc1",
    "wi",
    "wi_0",
    "wi_1",
    "w1",
    "w3",
    "up_proj",
    "gate_proj",
    "c_fc",
    "dense_h_to_4h",
    "head",
    "lm_head",
)
"""Module names of column-parallel layers (output features split)."""
ROW = ("proj", "out", "o_proj", "wo", "w2", "down_proj", "c_proj", "out_proj", "dense_4h_to_h", "fc2")
"""Module names of row-parallel layers (input features split, output all-reduced)."""
EMBED = ("wte", "embed", "embedding", "tok_embeddings", "word_embeddings")
"""Module names of token embeddings (vocabulary split)."""

_KEY = re.compile(r"\['([^']+)'\]|\.([A-Za-z_]\w*)")


def _module_name(path: str) -> str:
    keys = [a or b for a, b in _KEY.findall(path) if (a or b) not in ("value", "kernel", "bias", "embedding", "w", "b")]
    return keys[-1].lower() if keys else ""


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name == p or name.endswith("_" + p) for p in patterns)


def tensor_names(path: str, shape: tuple[int, ...]) -> tuple[str | None, ...] | None:
    """Logical names for a leaf at ``path`` (a `jax.tree_util.keystr`), or None when it is not a TP layer."""
    name, leaf = _module_name(path), path.rstrip("]'").rsplit("'", 1)[-1]
    if _matches(name, EMBED) and len(shape) == 2:
        return ("vocab", "embed")
    if _matches(name, COLUMN):
        return {2: ("embed", "mlp"), 1: ("mlp",)}.get(len(shape))
    if _matches(name, ROW):
        if len(shape) == 2:
            return ("mlp", "embed")
        if len(shape) == 1 and leaf == "bias":
            return ("embed",)
    return None


def base_specs(
    params: Any, sizes: Mapping[str, int], rules: Rules = DEFAULT_RULES, *, tensor_parallel: bool = True
) -> list[P]:
    """One spec per array leaf before ZeRO: annotated names (Flax metadata) through ``rules``, else tensor-parallel
    names for recognised attention / MLP / embedding layers (when ``tensor_parallel``), else replicated."""
    validate_rules(rules)
    annotated = logical_names(params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out = []
    for (path, leaf), names in zip(flat, annotated, strict=True):
        shape = tuple(leaf.shape)
        if tensor_parallel and sizes.get("tensor", 1) > 1:
            if names is None:
                names = tensor_names(jax.tree_util.keystr(path), shape)
            elif names[0] == LAYER_AXIS and not any(names[1:]):  # a stacked layer: name the layer's own dims
                inner = tensor_names(jax.tree_util.keystr(path), shape[1:])
                names = (LAYER_AXIS, *inner) if inner else names
        out.append(logical_spec(names, shape, sizes, rules) if names else P(*([None] * len(shape))))
    return out
