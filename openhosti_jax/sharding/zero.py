"""ZeRO stages as shardings of parameters, gradients and optimizer state.

Stage 0 replicates everything (DDP); 1 shards the optimizer state over the data-parallel axes; 2 also
reduce-scatters gradients; 3 also shards parameters (FSDP), which XLA gathers per use. The optimizer is an optax
`GradientTransformation` (its state's parameter-shaped leaves found by `optax.tree_map_params`) or, where only the
state is known (a user's ``(params, opt_state)``), the abstract optimizer state itself: then every leaf whose path
ends with a parameter's path and has its shape (Adam's ``mu`` and ``nu``, momentum's ``trace``) mirrors it.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.sharding.zero import zero_specs
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
    >>> p, g, o = zero_specs(params, optax.adam(1e-3), {"data": 8, "fsdp": 1}, stage=1)
    >>> p["w"], o[0].mu["w"]
    (P(None, None), P('data', None))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PlanningError
from openhosti_jax.sharding.rules import LAYER_AXIS, expert_specs, logical_names
from openhosti_jax.sharding.specs import DEFAULT_MIN_ELEMENTS, auto_spec, is_spec

ZERO_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
"""The data-parallel axes ZeRO shards state over (``expert`` is one outside the experts; a leaf of stacked experts,
split over it already, is sharded over the others)."""


Optimizer = optax.GradientTransformation | Any
"""An optax transformation, or the abstract state of one (a pytree), or None for an optimizer without state."""


def mirror_specs(tree: Any, params: Any, leaf_specs: Any) -> Any:
    """A spec per leaf of ``tree``: the spec (from ``leaf_specs``, a tree like ``params``) of the parameter whose
    path ends the leaf's path and whose shape it has; every other leaf replicated.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> params = {"w": jnp.ones((8, 2))}
        >>> specs = mirror_specs(optax.adam(0.1).init(params), params, {"w": P("fsdp", None)})
        >>> specs[0].mu["w"], specs[0].count
        (P('fsdp', None), P())
    """
    by_path = {
        tuple(p): (tuple(x.shape), s)
        for (p, x), s in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(leaf_specs, is_leaf=is_spec), strict=True
        )
    }

    def spec(path: Any, leaf: Any) -> P:
        path, shape = tuple(path), tuple(getattr(leaf, "shape", ()))
        for k in range(len(path)):
            found = by_path.get(path[k:])
            if found is not None and found[0] == shape:
                return found[1]
        return P()

    return jax.tree_util.tree_map_with_path(spec, tree)


_ABSTRACT: dict[tuple[int, int], tuple[Any, Any, Any]] = {}


def _abstract_state(tx: optax.GradientTransformation, params: Any) -> Any:
    """``jax.eval_shape(tx.init, params)``, remembered for the last few (tx, params) pairs: a search asks for the
    same one per candidate (the pair is held, so its ids stay theirs)."""
    key = (id(tx), id(params))
    if key not in _ABSTRACT:
        if len(_ABSTRACT) >= 8:
            del _ABSTRACT[next(iter(_ABSTRACT))]
        _ABSTRACT[key] = (tx, params, jax.eval_shape(tx.init, params))
    return _ABSTRACT[key][2]


def opt_state_specs(tx: Optimizer, params: Any, leaf_specs: Any) -> Any:
    """Specs for the optimizer's state: each parameter-shaped leaf (Adam mu, nu, ...) gets its parameter's spec,
    everything else (counts, scalars) is replicated. ``tx`` may be the abstract state itself (`mirror_specs`)."""
    if tx is None:
        return None
    if not isinstance(tx, optax.GradientTransformation):
        return mirror_specs(tx, params, leaf_specs)
    specs, treedef = jax.tree.flatten(leaf_specs, is_leaf=is_spec)
    if treedef != jax.tree.structure(params) or not all(is_spec(s) for s in specs):
        return _mapped_specs(tx, params, leaf_specs)
    state, slots = _slots(tx, params)  # which parameter each state leaf mirrors, found once per (tx, params)
    return jax.tree.unflatten(state, [P() if i < 0 else specs[i] for i in slots])


_SLOTS: dict[tuple[int, int], tuple[Any, Any, Any, list[int]]] = {}


def _slots(tx: optax.GradientTransformation, params: Any) -> tuple[Any, list[int]]:
    """(the structure of ``tx``'s state specs, for each of their leaves the index of the parameter leaf whose spec
    it takes or -1 for a replicated one): `_mapped_specs` of a spec per parameter that names only that parameter,
    remembered for the last few (tx, params) pairs (the pair is held, so its ids stay theirs). A search asks for the
    state specs of every candidate; they differ only in the parameters' specs."""
    key = (id(tx), id(params))
    if key not in _SLOTS:
        if len(_SLOTS) >= 8:
            del _SLOTS[next(iter(_SLOTS))]
        leaves, treedef = jax.tree.flatten(params)
        marks = [P(f"#{i}") for i in range(len(leaves))]
        mapped, state = jax.tree.flatten(_mapped_specs(tx, params, jax.tree.unflatten(treedef, marks)), is_leaf=is_spec)
        index = {m: i for i, m in enumerate(marks)}
        _SLOTS[key] = (tx, params, state, [index.get(m, -1) for m in mapped])
    return _SLOTS[key][2], _SLOTS[key][3]


def _mapped_specs(tx: optax.GradientTransformation, params: Any, leaf_specs: Any) -> Any:
    abstract_state = _abstract_state(tx, params)
    try:
        return optax.tree_map_params(
            tx,
            lambda _, spec: spec,
            abstract_state,
            leaf_specs,
            transform_non_params=lambda _: P(),
            is_leaf=is_spec,
        )
    except ValueError:  # a state whose parameter trees are partial (multi_transform's masked groups): by path
        return mirror_specs(abstract_state, params, leaf_specs)


def zero_specs(
    params: Any,
    tx: Optimizer,
    sizes: Mapping[str, int],
    stage: int,
    *,
    base_specs: Any | None = None,
    axes: Sequence[str] = ZERO_AXES,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
) -> tuple[Any, Any, Any]:
    """(param specs, gradient specs, optimizer-state specs) for ZeRO ``stage`` over ``axes``.

    ``base_specs`` are specs already chosen for other reasons (tensor parallelism, user annotations); ZeRO adds
    the data-parallel axes on top of them. Without them, leaves of stacked experts (logical name ``"experts"``) are
    split over ``expert`` (`openhosti_jax.sharding.rules.expert_specs`) and the rest start unsplit.
    """
    if stage not in (0, 1, 2, 3):
        raise PlanningError(f"ZeRO stage must be 0, 1, 2 or 3, found {stage!r}")
    if base_specs is None:
        base_specs = jax.tree.unflatten(jax.tree.structure(params), expert_specs(params, sizes))
    leaves, treedef = jax.tree.flatten(params)
    bases = jax.tree.leaves(base_specs, is_leaf=is_spec)
    names = logical_names(params)
    sharded = jax.tree.unflatten(
        treedef,
        [
            auto_spec(
                leaf.shape,
                sizes,
                axes,
                min_elements=min_elements,
                taken=tuple(base),
                frozen=tuple(d for d, n in enumerate(name or ()) if n == LAYER_AXIS),
            )
            for leaf, base, name in zip(leaves, bases, names, strict=True)
        ],
    )
    param_specs = sharded if stage >= 3 else base_specs
    grad_specs = sharded if stage >= 2 else base_specs
    opt_specs = opt_state_specs(tx, params, sharded if stage >= 1 else base_specs)
    return param_specs, grad_specs, opt_specs
