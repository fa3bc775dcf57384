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

from dataclasses import dataclass
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


Spec = tuple[tuple[int, ...], str, bool]
"""A stored leaf: (shape, dtype name, whether it is a typed PRNG key), in `flatten_state`'s stored form."""


def stored_specs(flat: dict[str, Any]) -> dict[str, list[Any]]:
    """``{name: [shape, dtype name]}`` of `flatten_state`'s output (JSON), to save with the checkpoint."""
    return {name: [list(np.shape(x)), np.dtype(x.dtype).name] for name, x in flat.items()}


def saved_specs(stored: dict[str, list[Any]], key_impls: dict[str, str]) -> dict[str, Spec]:
    """The `Spec` of every saved leaf, from `stored_specs`' JSON and the saved typed-key names."""
    return {name: (tuple(shape), str(dtype), name in key_impls) for name, (shape, dtype) in stored.items()}


def target_specs(abstract_state: Any, target: dict[str, jax.ShapeDtypeStruct]) -> dict[str, Spec]:
    """The `Spec` of every leaf `abstract_flat` made of ``abstract_state``."""
    keys = {n for n, x in zip(leaf_names(abstract_state), jax.tree.leaves(abstract_state), strict=True) if _is_key(x)}
    return {n: (tuple(x.shape), np.dtype(x.dtype).name, n in keys) for n, x in target.items()}


def _fmt(spec: Spec) -> str:
    shape, dtype, key = spec
    return f"{dtype}[{','.join(str(d) for d in shape)}]" + (" (typed PRNG key data)" if key else "")


@dataclass(frozen=True)
class LeafDiff:
    """How a checkpoint's leaves differ from the state being restored (names as the checkpoint stores them)."""

    changed: tuple[str, ...] = ()
    """``name: saved <spec>, wanted <spec>`` for every leaf both have with another shape, dtype or key-ness."""
    added: tuple[str, ...] = ()
    """Leaves of the state being restored that the checkpoint lacks."""
    removed: tuple[str, ...] = ()
    """Leaves of the checkpoint that the state being restored lacks."""
    renamed: tuple[str, ...] = ()
    """``old -> new`` hints: a removed and an added leaf of the same shape and dtype."""

    def __bool__(self) -> bool:
        return bool(self.changed or self.added or self.removed)

    def blocks(self, partial: bool) -> bool:
        """Whether a restore cannot go ahead (with ``partial``, added and removed leaves do not block)."""
        return bool(self.changed) or (not partial and bool(self.added or self.removed))

    def describe(self) -> str:
        """One line per difference."""
        lines = [f"  {c}" for c in self.changed]
        if self.added:
            lines.append(f"  added (in the state being restored, not in the checkpoint): {list(self.added)}")
        if self.removed:
            lines.append(f"  missing (in the checkpoint, not in the state being restored): {list(self.removed)}")
        lines += [f"  renamed? {r} (same shape and dtype)" for r in self.renamed]
        return "\n".join(lines)


def diff_leaves(saved: dict[str, Spec], wanted: dict[str, Spec]) -> LeafDiff:
    """Compare a checkpoint's leaf specs (``saved``) with the restore target's (``wanted``).

    Example:
        >>> from openhosti_jax.checkpoint.flat import diff_leaves
        >>> d = diff_leaves({"w": ((2,), "float32", False), "a": ((3,), "int32", False)},
        ...                 {"w": ((4,), "float32", False), "b": ((3,), "int32", False)})
        >>> d.changed, d.added, d.removed, d.renamed
        (('w: saved float32[2], wanted float32[4]',), ('b',), ('a',), ('a -> b',))
    """
    both = sorted(set(saved) & set(wanted))
    changed = tuple(f"{n}: saved {_fmt(saved[n])}, wanted {_fmt(wanted[n])}" for n in both if saved[n] != wanted[n])
    added, removed = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    renamed = []
    for old in removed:
        same = [new for new in added if wanted[new] == saved[old]]
        if len(same) == 1:
            renamed.append(f"{old} -> {same[0]}")
    return LeafDiff(changed, tuple(added), tuple(removed), tuple(renamed))
