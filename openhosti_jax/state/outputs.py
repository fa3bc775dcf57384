"""A step of any signature as the ``(state, data) -> (new_state, outputs)`` function the jitted core runs, and its
outputs given back to the caller as the step returned them.

`canonical_step` calls the user's step on the arguments a `StepCall` rebuilds from its view. The new state is, for
graph objects, their state after the step (so mutations in place survive the jit); for a pytree argument holding
parameters or optimizer state, the first subtree of the step's return value with that argument's structure, shapes
and dtypes (optax's ``return params, opt_state, loss``; flax's ``return state``); an argument the step does not
return is passed through unchanged. Everything else the step returns is its *outputs*, given back by `restore`
with the updated state, and the caller's own graph objects, in their places. An object of a registered kind in the
return value (the new equinox module of ``return model, opt_state, loss``) is matched and given back as its arrays,
merged again with its static part (`openhosti_jax.state.kinds`).

Example:
    >>> import jax.numpy as jnp, optax
    >>> from openhosti_jax.state.call import bind
    >>> from openhosti_jax.state.outputs import canonical_step, restore
    >>> params = {"w": jnp.ones(2)}
    >>> call = bind((params, optax.adam(0.1).init(params), jnp.ones(2)), {})
    >>> def step(p, opt, x):
    ...     return {"w": p["w"] * 2}, opt, jnp.sum(x)
    >>> fn, recipe = canonical_step(step, call, ("0", "1"))
    >>> new, out = fn({k: call.view[k] for k in ("0", "1")}, {"2": call.view["2"]})
    >>> sorted(recipe.returned), restore(recipe, new, out["outputs"], call)[0]["w"].tolist()
    (['0', '1'], [2.0, 2.0])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from openhosti_jax.errors import StepArgumentError
from openhosti_jax.state.call import StepCall, arg_name, is_graph_object
from openhosti_jax.state.kinds import merge_kinds, split_kinds


@dataclasses.dataclass(frozen=True)
class Slot:
    """A place in the step's return value filled after the step: a graph object, or a returned state argument."""

    graph: int | None = None
    """Index of the caller's graph object (`StepCall.nodes`)."""
    state: str | None = None
    """View key of the state argument returned here."""


@dataclasses.dataclass
class Recipe:
    """How the step's return value is rebuilt (known once the step has been traced)."""

    treedef: Any = None
    """The return value's structure, with the slots as leaves."""
    slots: tuple[Slot | None, ...] = ()
    """Per leaf: its slot, or None for an output leaf."""
    returned: frozenset[str] = frozenset()
    """The pytree state arguments the step returns."""
    traced: bool = False
    objects: tuple[Any, tuple] | None = None
    """The return value's objects of a registered kind (a new equinox module): the structure with them as leaves
    and their (kind, static part)s (`openhosti_jax.state.kinds.split_kinds`), to merge them back."""


def _same(node: Any, like: Any) -> bool:
    if jax.tree.structure(node) != jax.tree.structure(like):
        return False
    return all(
        np.shape(a) == np.shape(b) and jax.numpy.result_type(a) == jax.numpy.result_type(b)
        for a, b in zip(jax.tree.leaves(node), jax.tree.leaves(like), strict=True)
    )


def _split(out: Any, nodes: tuple[Any, ...], candidates: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``out`` with graph objects and returned state arguments replaced by slots, and the returned ones by key."""
    matched: dict[str, Any] = {}

    def walk(node: Any) -> Any:
        if is_graph_object(node):
            for i, n in enumerate(nodes):
                if n is node:
                    return Slot(graph=i)
            raise StepArgumentError(
                f"the step returned a new {type(node).__name__}, expected only the graph objects it took (which it "
                "may mutate in place) or pytrees of arrays; return its state (nnx.state(obj)) or mutate an argument"
            )
        for key, like in candidates.items():
            if key not in matched and _same(node, like):
                matched[key] = node
                return Slot(state=key)
        children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
        if treedef.num_leaves == 1 and treedef.num_nodes == 1 and children and children[0] is node:
            return node
        return treedef.unflatten([walk(c) for c in children])

    return walk(out), matched


def canonical_step(
    fn: Callable[..., Any], call: StepCall, state_keys: tuple[str, ...]
) -> tuple[Callable[[dict, dict], tuple[dict, dict]], Recipe]:
    """(``step(state, data) -> (new_state, {"outputs": [leaves]})`` running ``fn`` on the call ``call`` stands
    for, the `Recipe` its first trace fills in). ``state`` and ``data`` are the view's ``state_keys`` and the rest."""
    recipe = Recipe()
    graph = call.graph_keys()

    def step(state: dict, data: dict) -> tuple[dict, dict]:
        view = {**state, **data}
        args, kwargs, nodes = call.arguments(view)
        out, *objects = split_kinds(fn(*args, **kwargs), keep=is_graph_object)  # a returned module as its arrays
        recipe.objects = tuple(objects)
        pure = {k: state[k] for k in state_keys if k not in graph}
        walked, matched = _split(out, nodes, pure)
        flat, treedef = jax.tree_util.tree_flatten(walked, is_leaf=lambda x: isinstance(x, Slot))
        slots = tuple(x if isinstance(x, Slot) else None for x in flat)
        recipe.treedef, recipe.slots, recipe.returned, recipe.traced = treedef, slots, frozenset(matched), True
        after = call.with_graph_state(view, nodes)
        new = {k: matched[k] if k in matched else after[k] for k in state_keys}
        return new, {"outputs": [x for x in flat if not isinstance(x, Slot)]}

    return step, recipe


def restore(recipe: Recipe, new_state: dict, outputs: list[Any], call: StepCall) -> Any:
    """The step's return value as the caller's step returned it: outputs from the jitted step, the updated state
    arguments and the caller's (updated) graph objects in their slots."""
    rest = iter(outputs)
    leaves = [
        next(rest) if s is None else call.nodes[s.graph] if s.graph is not None else new_state[s.state]
        for s in recipe.slots
    ]
    return merge_kinds(recipe.treedef.unflatten(leaves), *recipe.objects)


def unreturned(recipe: Recipe, call: StepCall, state_keys: tuple[str, ...]) -> list[str]:
    """The state arguments the step neither returns nor holds only as graph objects (so they cannot be donated)."""
    out = []
    for key in state_keys:
        if key in recipe.returned:
            continue
        treedef, kinds = call.slots[key]
        if any(
            i is None and jax.tree.leaves(x) for i, x in zip(kinds, treedef.flatten_up_to(call.view[key]), strict=True)
        ):
            out.append(arg_name(key))
    return out
