"""Logical-axis rules: logical dimension names (``"mlp"``, ``"heads"``, ...) -> mesh axes, first free axis wins.

Names come from Flax metadata: ``nnx.Param(..., out_sharding=(...))`` / ``nnx.with_partitioning`` and linen
``nn.with_partitioning`` boxes (`logical_names` reads both). A rule list is ordered; for each dimension the first
rule for its name whose mesh axis has size > 1, is not used by another dimension of the same leaf and divides
the dimension is applied; a name with no applicable rule leaves the dimension unsharded.

Example:
    >>> from openhosti_jax.sharding.rules import DEFAULT_RULES, logical_spec
    >>> logical_spec(("embed", "mlp"), (512, 2048), {"tensor": 4, "fsdp": 2}, DEFAULT_RULES)
    P(None, 'tensor')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import meta
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import ShardingError
from openhosti_jax.mesh.config import AXES

Rules = Sequence[tuple[str, str | None]]
"""Ordered ``(logical name, mesh axis or None)`` pairs."""

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("batch", "fsdp"),
    ("experts", "expert"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("qkv", "tensor"),
    ("vocab", "tensor"),
    ("embed", None),
    ("kv", None),
    ("norm", None),
)
"""Tensor-parallel rules: hidden and head dims on ``tensor``, a mixture-of-experts layer's stacked experts on
``expert``; ZeRO adds ``data``/``fsdp`` (and ``expert`` where a leaf does not hold it) on top per stage."""

EXPERTS = "experts"
"""The logical name of a stacked experts dimension (`openhosti_jax.models.moe`): always split over the ``expert``
axis, even by a plan that applies no other rule (`expert_specs`)."""

LAYER_AXIS = "layers"
"""The logical name of a stacked (scanned) layer dimension, as MaxText and the flax examples name it: never sharded
by a rule or by ZeRO (a scan slices it one layer per iteration)."""

_METADATA_KEYS = ("out_sharding", "sharding", "sharding_names")


def validate_rules(rules: Rules) -> None:
    """Raise `ShardingError` listing every malformed rule."""
    problems = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            problems.append(f"rule {i}: expected a (logical name, mesh axis) pair, found {rule!r}")
        elif rule[1] is not None and rule[1] not in AXES:
            problems.append(f"rule {i} {rule!r}: mesh axis {rule[1]!r} is not one of {AXES} (or None)")
    if problems:
        raise ShardingError("invalid logical-axis rules:\n  " + "\n  ".join(problems))


def logical_spec(names: Sequence[str | None], shape: Sequence[int], sizes: Mapping[str, int], rules: Rules) -> P:
    """The PartitionSpec for a leaf of ``shape`` whose dims carry logical ``names``."""
    if len(names) != len(shape):
        raise ShardingError(
            f"logical names {tuple(names)} have {len(names)} entries but the leaf has shape {tuple(shape)}; "
            "give one name (or None) per dimension"
        )
    used: set[str] = set()
    out: list[str | None] = []
    for name, dim in zip(names, shape, strict=True):
        chosen = None
        for logical, axis in rules:
            if logical != name or axis is None:
                continue
            n = sizes.get(axis, 1)
            if n > 1 and axis not in used and dim % n == 0:
                chosen = axis
                break
        if chosen:
            used.add(chosen)
        out.append(chosen)
    return P(*out)


def expert_specs(params: Any, sizes: Mapping[str, int]) -> list[P]:
    """One spec per array leaf: the dim named `EXPERTS` over the ``expert`` axis where that axis is larger than 1,
    every other dim unsplit; `ShardingError` naming each leaf whose experts the axis does not divide.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> w = nnx.Param(jnp.zeros((8, 4, 16)), out_sharding=("experts", "embed", "mlp"), eager_sharding=False)
    >>> expert_specs({"w": w, "b": jnp.zeros(3)}, {"expert": 4})
    [P(None,), P('expert', None, None)]
    """
    n = int(sizes.get("expert", 1))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out, problems = [], []
    for (path, leaf), names in zip(flat, logical_names(params), strict=True):
        spec: list[str | None] = [None] * len(leaf.shape)
        if n > 1 and names and EXPERTS in names:
            d = names.index(EXPERTS)
            if leaf.shape[d] % n:
                problems.append(
                    f"params{jax.tree_util.keystr(path)}: {leaf.shape[d]} experts (dim {d} of shape "
                    f"{tuple(leaf.shape)}) do not divide over the 'expert' axis of size {n}"
                )
            spec[d] = "expert"
        out.append(P(*spec))
    if problems:
        raise ShardingError(
            "experts must split evenly over the 'expert' axis:\n  "
            + "\n  ".join(problems)
            + "\nuse an 'expert' axis size that divides the expert count"
        )
    return out


def _is_box(x: Any) -> bool:
    return isinstance(x, nnx.Variable | meta.AxisMetadata)


def _names_of(node: Any) -> tuple[str | None, ...] | None:
    if isinstance(node, nnx.Variable):
        md = node.get_metadata()
        for key in _METADATA_KEYS:
            value = md.get(key)
            if value and not isinstance(value, jax.sharding.Sharding):
                return tuple(value)
        return None
    if isinstance(node, meta.Partitioned):
        return tuple(node.names)
    return None


def logical_names(tree: Any) -> list[tuple[str | None, ...] | None]:
    """Per array leaf (in `jax.tree.leaves` order), the logical dim names from its Flax metadata, or None."""
    nodes = jax.tree.leaves(tree, is_leaf=_is_box)
    out: list[tuple[str | None, ...] | None] = []
    for node in nodes:
        n_arrays = len(jax.tree.leaves(node)) if _is_box(node) else 1
        out += [_names_of(node)] * n_arrays
    return out


def unbox(tree: Any) -> Any:
    """``tree`` with linen partitioning boxes replaced by their values (nnx State is returned as is)."""
    return (
        meta.unbox(tree)
        if any(isinstance(x, meta.AxisMetadata) for x in jax.tree.leaves(tree, is_leaf=_is_box))
        else tree
    )
