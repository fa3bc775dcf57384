"""A train step's call, whatever its signature, as the ``(state, data)`` pair the jitted core runs.

``@spmd`` takes any step ``jax.jit`` or ``nnx.jit`` takes: flax's ``train_step(model, optimizer, metrics, batch)``
that mutates nnx graph objects in place, optax's ``step(params, opt_state, batch) -> (params, opt_state, loss)``,
extra PRNG keys, step counters and static flags. `bind` splits one call:

- static arguments (``static_argnums`` / ``static_argnames``, resolved against the signature as ``jax.jit`` does)
  stay out of the trace and key the compiled step;
- nnx graph objects, wherever they sit in the arguments, are split together (`nnx.split`: a variable two of them
  share is one leaf), and their state takes their place; the result is the call's *view*: a dict of pytrees of
  arrays keyed by each argument's position (``"0"``, ``"1"``, ...) or keyword;
- objects of a registered kind (`openhosti_jax.state.kinds`: equinox modules) are split into their arrays, in the
  view, and a static rest, which keys the compiled step (``eqx.filter_jit``'s treatment);
- every other leaf must be an array or a Python number (`StepArgumentError` naming every other one, and the kinds
  a step argument may be).

`call_layout` finds the parameters (the nnx ``Param`` variables, else `find_layout` over the whole view) and the
optimizer state; the arguments that hold them or a graph object are the *state* (sharded by the plan, updated,
donated), the others the *data*. `openhosti_jax.sharding.batch.batch_leaves` says which data leaves are split
over the data axes: those whose leading dimension is the batch size; every other data leaf (scalars, PRNG keys of
any form, tables) is replicated.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from openhosti_jax.state.call import arg_path, bind, call_layout
    >>> params = {"w": jnp.ones((4, 2))}
    >>> call = bind((params, optax.adam(0.1).init(params), {"x": jnp.ones((8, 4))}, 3), {})
    >>> layout, keys = call_layout(call)
    >>> layout.describe(where=arg_path), keys
    ('parameters at args[0], optimizer state at args[1]', ('0', '1'))
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx.graph import is_graph_node

from openhosti_jax.errors import StateError, StepArgumentError
from openhosti_jax.sharding.batch import is_key
from openhosti_jax.state.kinds import known_kinds, merge_kinds, split_kinds, statics
from openhosti_jax.state.layout import Path, StateLayout, find_layout, layout_of_params

LEAF_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex, jax.ShapeDtypeStruct)
"""What a step argument's leaves may be (as for ``jax.jit``), besides nnx graph objects."""


def is_graph_object(x: Any) -> bool:
    """Whether ``x`` is an nnx graph object (a module, an optimizer, a metric): a graph node that is not a variable
    (variables inside pytrees such as an ``nnx.State`` are pytree nodes around their arrays)."""
    return is_graph_node(x) and not isinstance(x, nnx.Variable)


def arg_name(key: str) -> str:
    """A view key as the caller wrote the argument: ``args[0]`` for a position, the keyword itself otherwise."""
    return f"args[{key}]" if key.isdigit() else key


def arg_path(path: Path) -> str:
    """A view path as the caller would index the arguments: ``args[1]['w']``, ``batch['x']``."""
    if not path:
        return "the arguments"
    return arg_name(str(path[0].key)) + jax.tree_util.keystr(tuple(path[1:]))


def static_arguments(fn: Callable, argnums: tuple[int, ...], argnames: tuple[str, ...]) -> tuple[set, set]:
    """(positions, names) of ``fn``'s static arguments: each given one, and its counterpart in the signature (a
    static name's position, a static position's name), as ``jax.jit`` resolves them."""
    nums, names = set(argnums), set(argnames)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in kinds]
    nums |= {i for i, p in enumerate(positional) if p.name in names}
    names |= {positional[i].name for i in nums if 0 <= i < len(positional)}
    return nums, names


def _leaf_problem(x: Any, where: str) -> str | None:
    """What is wrong with the step argument leaf ``x`` at ``where``, and its fix; None for an array, a number or
    None."""
    if x is None or isinstance(x, LEAF_TYPES):
        return None
    fix = (
        "close over it in the step, or keep it in an equinox Module (whose non-array leaves are static, as "
        "eqx.filter_jit treats them)"
        if callable(x) and not isinstance(x, type)
        else "or, if it holds arrays to train, make its type a pytree (jax.tree_util.register_dataclass, "
        "flax.struct.dataclass) or register its kind (openhosti_jax.state.kinds.register_kind)"
    )
    return (
        f"step argument {where}: expected a pytree of arrays (or Python numbers), an nnx graph object or an object "
        f"of a kind the library knows, found {type(x).__module__}.{type(x).__qualname__}; pass it as a static "
        f"argument (spmd(..., static_argnums=...) or static_argnames=..., as jax.jit takes them), {fix}"
    )


def _check_leaves(problems: list[str]) -> None:
    """`StepArgumentError` naming every bad leaf at once, and the kinds a step argument may be."""
    if problems:
        raise StepArgumentError("\n".join(problems) + f"\nThe kinds a step argument may be:\n{known_kinds()}")


@dataclasses.dataclass(frozen=True)
class StepCall:
    """One call of a step split into its view (state and data as pytrees of arrays), graph and static parts."""

    view: dict[str, Any]
    """Every dynamic argument as a pytree of arrays (graph objects as their nnx state), keyed by position/keyword."""
    graphdef: Any
    """The `nnx.GraphDef` of the call's graph objects (None without any)."""
    nodes: tuple[Any, ...]
    """The caller's graph objects, in split order (updated in place after the step)."""
    slots: dict[str, tuple[Any, tuple[int | None, ...]]]
    """Per view key: the argument's structure with graph objects as leaves, and each leaf's graph index (or None)."""
    static: tuple[tuple[int | str, Any], ...]
    """(position or keyword, value) of every static argument."""
    positions: int
    """How many positional arguments the call has."""
    objects: dict[str, tuple[Any, tuple]] = dataclasses.field(default_factory=dict)
    """Per view key holding objects of a registered kind (`openhosti_jax.state.kinds`): the argument's structure
    with them as leaves, and per leaf its (kind, static part) or None; the view holds their arrays."""

    def key(self) -> Hashable:
        """What a compiled step is cached by: the graph, the static values (those of objects of a registered kind
        too) and the view's structure."""
        parts = tuple((k, tree, statics(p)) for k, (tree, p) in sorted(self.objects.items()))
        return (self.graphdef, self.static, self.positions, jax.tree.structure(self.view), parts)

    def graph_keys(self) -> frozenset[str]:
        """The view keys whose argument holds a graph object."""
        return frozenset(k for k, (_, kinds) in self.slots.items() if any(i is not None for i in kinds))

    def arguments(self, view: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
        """(args, kwargs, graph objects) to call the step with, built from ``view`` (traced inside the step): the
        graph objects are merged from their state, fresh, so the step may mutate them."""
        pieces = {}
        for key, (treedef, kinds) in self.slots.items():
            for i, x in zip(kinds, treedef.flatten_up_to(view[key]), strict=True):
                if i is not None:
                    pieces[i] = x
        nodes = nnx.merge(self.graphdef, nnx.State(pieces), copy=True) if self.nodes else ()
        built = {
            key: treedef.unflatten(
                [x if i is None else nodes[i] for i, x in zip(kinds, treedef.flatten_up_to(view[key]), strict=True)]
            )
            for key, (treedef, kinds) in self.slots.items()
        }
        for key, (tree, parts) in self.objects.items():
            built[key] = merge_kinds(built[key], tree, parts)
        built.update({str(k) if isinstance(k, int) else k: v for k, v in self.static})
        args = tuple(built[str(i)] for i in range(self.positions))
        kwargs = {k: v for k, v in built.items() if not k.isdigit()}
        return args, kwargs, tuple(nodes)

    def with_graph_state(self, view: dict[str, Any], nodes: tuple[Any, ...]) -> dict[str, Any]:
        """``view`` with the state of ``nodes`` (the merged graph objects, after the step) in their places."""
        if not nodes:
            return dict(view)
        state = nnx.state(nodes)
        out = dict(view)
        for key in self.graph_keys():
            treedef, kinds = self.slots[key]
            flat = treedef.flatten_up_to(view[key])
            out[key] = treedef.unflatten(
                [
                    x if i is None else state[i] if i in state else nnx.State({})
                    for i, x in zip(kinds, flat, strict=True)
                ]
            )
        return out

    def update_graph(self, view: dict[str, Any]) -> None:
        """Write the graph state in ``view`` (the step's output) into the caller's graph objects, in place."""
        if not self.nodes:
            return
        pieces = {}
        for key in self.graph_keys():
            treedef, kinds = self.slots[key]
            for i, x in zip(kinds, treedef.flatten_up_to(view[key]), strict=True):
                if i is not None:
                    pieces[i] = x
        nnx.update(self.nodes, nnx.State(pieces))


def bind(args: tuple[Any, ...], kwargs: dict[str, Any], static: tuple[set, set] = (set(), set())) -> StepCall:
    """Split one call ``step(*args, **kwargs)``; ``static`` is (positions, names) from `static_arguments`.

    Raises `StepArgumentError` for a leaf that is neither an array, a number nor a graph object, and for an
    unhashable static argument."""
    nums = {i + len(args) if i < 0 else i for i in static[0]}
    chosen = [(i, a) for i, a in enumerate(args) if i in nums] + [(k, v) for k, v in kwargs.items() if k in static[1]]
    for where, value in chosen:
        try:
            hash(value)
        except TypeError:
            raise StepArgumentError(
                f"static step argument {arg_name(str(where))}: expected a hashable value (jax.jit's rule for static "
                f"arguments), found an unhashable {type(value).__name__}; pass a tuple or a frozen dataclass, or "
                "make the argument dynamic (drop it from static_argnums / static_argnames)"
            ) from None
    given = {str(i): a for i, a in enumerate(args) if i not in nums}
    given.update({k: v for k, v in kwargs.items() if k not in static[1]})
    dynamic, objects = {}, {}
    for key, value in given.items():  # objects of a registered kind (equinox modules) as their arrays
        dynamic[key], *objects[key] = split_kinds(value, keep=is_graph_object)
    nodes: list[Any] = []
    index: dict[int, int] = {}
    slots = {}
    problems = []
    for key, value in dynamic.items():
        flat, treedef = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_graph_object)
        kinds = []
        for path, x in flat:
            if is_graph_object(x):
                if id(x) not in index:
                    index[id(x)] = len(nodes)
                    nodes.append(x)
                kinds.append(index[id(x)])
            else:
                problems.append(_leaf_problem(x, arg_name(key) + jax.tree_util.keystr(path)))
                kinds.append(None)
        slots[key] = (treedef, tuple(kinds))
    _check_leaves([p for p in problems if p is not None])
    graphdef, state = nnx.split(tuple(nodes)) if nodes else (None, None)
    view = {}
    for key, (treedef, kinds) in slots.items():
        flat = jax.tree.leaves(dynamic[key], is_leaf=is_graph_object)
        view[key] = treedef.unflatten(
            [x if i is None else state[i] if i in state else nnx.State({}) for i, x in zip(kinds, flat, strict=True)]
        )
    kinds = {k: (tree, parts) for k, (tree, parts) in objects.items() if any(parts)}
    return StepCall(view, graphdef, tuple(nodes), slots, tuple(chosen), len(args), kinds)


def _param_leaves(view: dict[str, Any]) -> list[Path]:
    """Paths of the array leaves of every nnx ``Param`` variable in ``view``."""
    out = []
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    for path, var in jax.tree_util.tree_flatten_with_path(view, is_leaf=is_var)[0]:
        if isinstance(var, nnx.Param):
            out += [tuple(path) + tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(var)[0]]
    return out


def call_layout(
    call: StepCall, *, params: str | None = None, opt_state: str | None = None
) -> tuple[StateLayout, tuple[str, ...]]:
    """(where the call's parameters and optimizer state are, in view paths; the view keys that are state).

    ``params`` / ``opt_state`` are dotted view paths (``"0"``, ``"1.opt_state"``, ``"state.params"``) that
    override the search. Raises `StateError` when the parameters cannot be told apart from the data arguments."""
    view = call.view
    found = _param_leaves(view) if params is None else []
    if found:
        layout = layout_of_params(view, found, opt_state=opt_state)
    else:
        layout = find_layout(view, params=params, opt_state=opt_state, arguments=True)
        if not layout.params_path:
            holders = sorted(
                {arg_name(str(p[0].key)) for p, x in jax.tree_util.tree_flatten_with_path(view)[0] if _floating(x)}
            )
            raise StateError(
                "cannot tell the step's parameters apart from its data arguments: expected one argument (or a node "
                "in one) holding the parameters, mirrored by an optimizer state, found floating-point leaves in "
                f"{', '.join(holders)} and no optimizer state that mirrors any of them (a stateless optimizer such "
                "as plain SGD); name them with spmd(..., params='0') (and opt_state='1'): a dotted path whose first "
                "part is the argument's position or keyword, e.g. params='0.params'"
            )
    keys = set(call.graph_keys())
    if layout.param_rels is not None and not layout.params_path:
        keys |= {str(rel[0].key) for rel in layout.param_rels}
    for path in (layout.params_path, layout.opt_path):
        if path:
            keys.add(str(path[0].key))
    return layout, tuple(k for k in view if k in keys)


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not is_key(x) and jax.numpy.issubdtype(dtype, jax.numpy.floating)
