"""The kinds of objects a train step may take besides pytrees of arrays, each with how to recognise it, split it
into arrays and a static part, and merge the two back.

``@spmd`` traces a step on arrays only. A step argument is a pytree whose leaves are arrays (or Python numbers), an
nnx graph object (split by `openhosti_jax.state.call.bind` with ``nnx.split``), or an object of a registered
`StateKind`. Built in: equinox modules, with ``eqx.partition(module, eqx.is_array)`` / ``eqx.combine`` semantics
as ``eqx.filter_jit`` treats them: the module's arrays are traced, placed and donated, and everything else in it
(its activation functions, Python ints such as a hidden size) is static, part of what the compiled step is cached
by. Register another kind with `register_kind`; an object of none of these kinds is a `StepArgumentError` listing
them (`known_kinds`).

Example:
    >>> import dataclasses, jax.numpy as jnp
    >>> from openhosti_jax.state.kinds import StateKind, kind_of, register_kind, unregister_kind
    >>> @dataclasses.dataclass
    ... class Scaled:  # not a pytree: a weight and the function that uses it
    ...     w: jnp.ndarray
    ...     fn: object
    >>> kind = StateKind(
    ...     "scaled", lambda x: isinstance(x, Scaled), lambda x: ({"w": x.w}, x.fn), lambda d, s: Scaled(d["w"], s)
    ... )
    >>> register_kind(kind)
    >>> arrays, static = kind_of(Scaled(jnp.ones(2), abs)).split(Scaled(jnp.ones(2), abs))
    >>> arrays["w"].shape, static is abs
    ((2,), True)
    >>> unregister_kind("scaled")
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from openhosti_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StateKind:
    """A kind of step argument that is not a pytree of arrays."""

    name: str
    """What the kind is called in messages (``"equinox module"``)."""
    recognise: Callable[[Any], bool]
    """``recognise(x)``: whether ``x`` is of this kind (must not import an optional framework)."""
    split: Callable[[Any], tuple[Any, Hashable]]
    """``split(x) -> (arrays, static)``: a pytree whose leaves are arrays, and a hashable rest (the compiled step is
    cached by it)."""
    merge: Callable[[Any, Hashable], Any]
    """``merge(arrays, static)``: the object again (inside the trace, ``arrays`` are traced)."""
    example: str = ""
    """A short example of such an object, for `known_kinds`."""


def _equinox() -> Any:
    return sys.modules.get("equinox")  # no equinox imported: no value can be one of its modules


def _is_eqx_module(x: Any) -> bool:
    eqx = _equinox()
    return eqx is not None and isinstance(x, eqx.Module)


def _eqx_split(module: Any) -> tuple[Any, Hashable]:
    eqx = _equinox()
    arrays, static = eqx.partition(module, eqx.is_array)
    leaves, treedef = jax.tree.flatten(static)
    return arrays, (treedef, tuple(leaves))


def _eqx_merge(arrays: Any, static: Hashable) -> Any:
    treedef, leaves = static
    return _equinox().combine(arrays, jax.tree.unflatten(treedef, list(leaves)))


EQUINOX = StateKind(
    "equinox module",
    _is_eqx_module,
    _eqx_split,
    _eqx_merge,
    "eqx.nn.MLP(...), a class deriving from eqx.Module: its arrays traced, the rest static, as eqx.filter_jit does",
)

_KINDS: list[StateKind] = [EQUINOX]

BUILT_IN = (
    "arrays and Python numbers, in any pytree: dicts, lists, tuples, NamedTuples, flax.struct dataclasses such as "
    "flax's TrainState and the library's, linen variable dicts ({'params': ...}), optax states",
    "nnx graph objects: nnx.Module, nnx.Optimizer, nnx.Metric (split with nnx.split, updated in place)",
)
"""The kinds every step takes without a registered `StateKind`."""


def register_kind(kind: StateKind) -> None:
    """Let step arguments of ``kind`` through ``@spmd`` (checked before the built-in kinds registered after it);
    `ConfigError` for a name already registered."""
    if any(k.name == kind.name for k in _KINDS):
        raise ConfigError(
            f"a state kind named {kind.name!r} is registered already; expected a new name, found a duplicate; "
            "unregister_kind it first to replace it"
        )
    _KINDS.insert(0, kind)


def unregister_kind(name: str) -> None:
    """Forget the kind named ``name``."""
    _KINDS[:] = [k for k in _KINDS if k.name != name]


def kind_of(x: Any) -> StateKind | None:
    """The registered kind of ``x``, or None (a pytree node, an array, a number, a graph object or an unknown)."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)) or x is None:
        return None
    return next((k for k in _KINDS if k.recognise(x)), None)


def is_kind_object(x: Any) -> bool:
    """Whether ``x`` is an object of a registered kind (an equinox module, ...)."""
    return kind_of(x) is not None


def known_kinds() -> str:
    """Every kind a step argument may be, one per line, for error messages."""
    lines = [f"  - {k}" for k in BUILT_IN]
    lines += [f"  - {k.name}" + (f": {k.example}" if k.example else "") for k in _KINDS]
    return "\n".join(lines)


def split_kinds(
    tree: Any, keep: Callable[[Any], bool] = lambda x: False
) -> tuple[Any, Any, tuple[tuple[StateKind, Hashable] | None, ...]]:
    """(``tree`` with every object of a registered kind replaced by its arrays, the structure with those objects
    (and the nodes ``keep`` says, kept whole) as leaves, per such leaf its (kind, static part) or None) for
    `merge_kinds`."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: keep(x) or is_kind_object(x))
    arrays, parts = [], []
    for x in leaves:
        kind = kind_of(x)
        if kind is None:
            arrays.append(x)
            parts.append(None)
        else:
            dynamic, static = kind.split(x)
            arrays.append(dynamic)
            parts.append((kind, static))
    return treedef.unflatten(arrays), treedef, tuple(parts)


def merge_kinds(arrays: Any, treedef: Any, parts: tuple[tuple[StateKind, Hashable] | None, ...]) -> Any:
    """The tree `split_kinds` split, from its arrays (traced or not)."""
    if not any(parts):
        return arrays
    flat = treedef.flatten_up_to(arrays)
    return treedef.unflatten([x if p is None else p[0].merge(x, p[1]) for x, p in zip(flat, parts, strict=True)])


def statics(parts: tuple[tuple[StateKind, Hashable] | None, ...]) -> Hashable:
    """What a compiled step is cached by for these parts: each kind's name and static part."""
    return tuple(None if p is None else (p[0].name, p[1]) for p in parts)
