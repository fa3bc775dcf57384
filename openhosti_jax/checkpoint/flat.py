"""A training state as a flat ``{name: array}`` dict for Orbax, and back.

Names are the pytree paths joined by dots (``params.Dense_0.kernel``, ``opt_state.0.mu.Dense_0.kernel``); they
name the arrays on disk and in every error. Typed PRNG keys (``jax.random.key``) are stored as their raw
``uint32`` key data and re-wrapped on restore, so a restored ``rng`` is bit-identical.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.checkpoint.flat import flatten_state
    >>> flat, keys = flatten_state({"w": jnp.ones(2), "rng": jax.random.key(0)})
    >>> sorted(flat), keys
    (['rng', 'w'], {'rng': 'threefry2x32'})
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from openhosti_jax.errors import CheckpointError


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def leaf_names(tree: Any) -> list[str]:
    """The dotted path of every leaf of ``tree`` (in ``jax.tree.leaves`` order)."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    names = [jax.tree_util.keystr(p, simple=True, separator=".") or "value" for p in paths]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"pytree paths collide after joining with '.': {dup}; rename those keys")
    return names


def flatten_state(state: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(``{name: array}`` with keys replaced by their data, ``{name: key impl}`` of the typed-key leaves)."""
    flat: dict[str, Any] = {}
    key_impls: dict[str, str] = {}
    for name, leaf in zip(leaf_names(state), jax.tree.leaves(state), strict=True):
        if _is_key(leaf):
            key_impls[name] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        elif not isinstance(leaf, jax.Array):
            leaf = np.asarray(leaf)
        flat[name] = leaf
    return flat, key_impls


def _data_sharding(sharding: Any, extra_dims: int) -> Any:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, *([None] * extra_dims)))
    return sharding  # single-device / replicated shardings fit any rank


def abstract_flat(abstract_state: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The restore target of `flatten_state`'s output: ``{name: ShapeDtypeStruct with sharding}``.

    Raises `CheckpointError` naming every leaf that is not an array / ShapeDtypeStruct with a sharding.
    """
    out: dict[str, jax.ShapeDtypeStruct] = {}
    bad = []
    for name, leaf in zip(leaf_names(abstract_state), jax.tree.leaves(abstract_state), strict=True):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not hasattr(leaf, "shape"):
            bad.append(f"{name} ({type(leaf).__name__})")
            continue
        if _is_key(leaf):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            extra = len(data.shape) - len(leaf.shape)
            out[name] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=_data_sharding(sharding, extra))
        else:
            out[name] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    if bad:
        raise CheckpointError(
            f"expected every leaf of abstract_state to be a jax.ShapeDtypeStruct or array with a sharding; "
            f"found {', '.join(bad)}; build it with openhosti_jax.state.abstract_train_state(state) or "
            "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))"
        )
    return out


def unflatten_state(abstract_state: Any, flat: dict[str, Any], key_impls: dict[str, str]) -> Any:
    """Rebuild ``abstract_state``'s pytree from restored ``{name: array}``, re-wrapping typed keys."""
    names = leaf_names(abstract_state)
    leaves = []
    for name in names:
        x = flat[name]
        if name in key_impls:
            x = jax.random.wrap_key_data(x, impl=key_impls[name])
        leaves.append(x)
    return jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)


def check_same_leaves(saved: list[str], wanted: list[str], step: int) -> None:
    """Raise `CheckpointError` listing the leaves only one side has."""
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint step {step} does not match abstract_state: missing in the checkpoint {missing}, "
            f"only in the checkpoint {extra}; restore with the same model and optimizer structure"
        )
