"""The repeated blocks of a user's model, found without changing its code, and the remat policy applied per block.

nnx: an attribute holding two or more submodules of one class (a list, an ``nnx.List``, a tuple or a dict of
them), or a submodule whose parameters are stacked over a leading ``"layers"`` axis (``nnx.vmap`` with
``transform_metadata={nnx.PARTITION_NAME: "layers"}``, called under ``nnx.scan``). Each block's class is swapped,
on the merged copy the apply function builds, for a subclass whose ``__call__`` runs under ``nnx.remat``.

linen: sibling submodules whose parameter subtrees have one structure and the same shapes (``Block_0``,
``Block_1``, ...), or a subtree stacked over ``"layers"`` (``nn.scan``); their ``__call__`` runs under
`jax.checkpoint` through `flax.linen.intercept_methods`.

Example:
    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])
    ...         self.head = nnx.Linear(4, 1, rngs=rngs)
    >>> [path for path, _ in nnx_blocks(Net(nnx.Rngs(0)))]
    [('layers', 0), ('layers', 1), ('layers', 2)]
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from flax import linen, nnx
from flax.nnx import graph

from openhosti_jax.policies.remat import check_remat, checkpoint, jax_policy
from openhosti_jax.sharding.rules import LAYER_AXIS, logical_names
from openhosti_jax.state.context import activation_key, constrain_activation


def _children(module: nnx.Module) -> Iterator[tuple[Any, Any]]:
    for name, value in vars(module).items():
        if not name.startswith("_"):
            yield name, value


def _group(value: Any) -> list[tuple[Any, nnx.Module]] | None:
    """(key, module) pairs when ``value`` holds two or more submodules of one class."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple, nnx.List)):
        items = list(enumerate(value))
    else:
        return None
    if len(items) < 2 or not all(isinstance(m, nnx.Module) for _, m in items):
        return None
    return items if len({type(m) for _, m in items}) == 1 else None


def _stacked(module: nnx.Module) -> bool:
    """Whether every parameter of ``module`` is stacked over a leading ``"layers"`` axis."""
    names = logical_names(nnx.state(module, nnx.Param))
    return bool(names) and all(n is not None and len(n) > 0 and n[0] == LAYER_AXIS for n in names)


def nnx_blocks(module: nnx.Module, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], nnx.Module]]:
    """(path, block) for every repeated block under ``module``, outermost first (blocks are not searched)."""
    found = []
    for name, value in _children(module):
        group = _group(value)
        if group is not None:
            found += [((*path, name, key), m) for key, m in group]
        elif isinstance(value, nnx.Module):
            found += [((*path, name), value)] if _stacked(value) else nnx_blocks(value, (*path, name))
    return found


def stack_modules(make: Any, count: int, rngs: nnx.Rngs) -> nnx.Module:
    """One module made by ``make(rngs)`` whose parameters are stacked over a leading ``"layers"`` axis of size
    ``count`` (``nnx.vmap`` over split RNG streams): the layers a scanned model runs with ``nnx.scan``."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
    def build(r: nnx.Rngs) -> nnx.Module:
        return make(r)

    return build(rngs)


@functools.cache
def _remat_class(cls: type, name: str) -> type:
    base_call = cls.__call__
    policy = jax_policy(name)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=graph.is_graph_node)
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) or graph.is_graph_node(x)]

        def body(module: Any, *values: Any) -> Any:
            full = list(leaves)
            for i, v in zip(dynamic, values, strict=True):
                full[i] = v
            a, k = jax.tree.unflatten(tree, full)
            return base_call(module, *a, **k)

        return nnx.remat(body, policy=policy)(self, *(leaves[i] for i in dynamic))

    return type(
        cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )


def remat_nnx(module: nnx.Module, name: str) -> int:
    """Make every repeated block of ``module`` (in place: call it on a copy) run under the remat policy ``name``;
    return how many blocks were found (0: none, the caller checkpoints the whole call)."""
    if check_remat(name) == "none":
        return 0
    blocks = nnx_blocks(module)
    for _, block in blocks:
        block.__class__ = _remat_class(type(block), name)
    return len(blocks)


@functools.cache
def _sequence_class(cls: type, placement: Any) -> type:
    """``cls`` whose call places its input and output; one class per ``placement`` (`activation_key`): jax reuses
    a traced loop body for the same function and input types, so a class shared between placements would carry
    the first one's constraints into a step traced under another (a sequence-parallel step compiled after a plain
    one kept the plain one's activations whole)."""
    del placement  # the class's identity, read back at trace time from the active context
    base_call = cls.__call__

    def __call__(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        out = base_call(self, constrain_activation(x), *args, **kwargs)
        if isinstance(out, tuple) and out:
            return (constrain_activation(out[0]), *out[1:])
        return constrain_activation(out)

    return type(
        cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )


def sequence_nnx(module: nnx.Module) -> int:
    """Make every repeated block of ``module`` (in place: call it on a copy) take and return its activations split
    along the sequence where a plan asks (`openhosti_jax.state.context.constrain_activation`); return the count."""
    blocks = nnx_blocks(module)
    for _, block in blocks:
        block.__class__ = _sequence_class(type(block), activation_key())
    return len(blocks)


def linen_block_paths(params: Mapping) -> set[tuple[str, ...]]:
    """Module paths of the repeated blocks in linen ``params``: siblings with one structure and the same shapes
    (two or more), or a subtree stacked over ``"layers"``; blocks are not searched further."""
    found: set[tuple[str, ...]] = set()

    def shape_key(tree: Any) -> Any:
        return jax.tree.structure(tree), tuple(getattr(x, "shape", ()) for x in jax.tree.leaves(tree))

    def visit(tree: Mapping, path: tuple[str, ...]) -> None:
        subs = {k: v for k, v in tree.items() if isinstance(v, Mapping)}
        groups: dict[Any, list[str]] = {}
        for k, v in subs.items():
            if jax.tree.leaves(v):
                groups.setdefault(shape_key(v), []).append(k)
        blocks = {k for ks in groups.values() if len(ks) >= 2 for k in ks}
        for k, v in subs.items():
            names = logical_names(v)
            if k in blocks or (names and all(n and n[0] == LAYER_AXIS for n in names)):
                found.add((*path, k))
            else:
                visit(v, (*path, k))

    visit(params, ())
    return found


@contextlib.contextmanager
def remat_linen(block_paths: set[tuple[str, ...]], name: str) -> Iterator[None]:
    """Within the block, linen modules at ``block_paths`` run ``__call__`` under the remat policy ``name``."""
    if check_remat(name) == "none" or not block_paths:
        yield
        return

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        if context.method_name != "__call__" or tuple(context.module.path) not in block_paths:
            return next_fun(*args, **kwargs)
        return checkpoint(next_fun, name)(*args, **kwargs)

    with linen.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def sequence_linen(block_paths: set[tuple[str, ...]]) -> Iterator[None]:
    """Within the block, linen modules at ``block_paths`` take and return their activations split along the
    sequence where a plan asks (`openhosti_jax.state.context.constrain_activation`)."""

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        if context.method_name != "__call__" or tuple(context.module.path) not in block_paths or not args:
            return next_fun(*args, **kwargs)
        out = next_fun(constrain_activation(args[0]), *args[1:], **kwargs)
        return (constrain_activation(out[0]), *out[1:]) if isinstance(out, tuple) and out else constrain_activation(out)

    with linen.intercept_methods(interceptor):
        yield


BLOCK_NAME = "openhosti_block"
"""The name a marked block call carries in a traced program (`mark_nnx`, `mark_linen`): where a pipeline cuts."""


def marked_call(fn: Any) -> Any:
    """``fn`` jitted under the name `BLOCK_NAME`, so its call is one equation of the enclosing program."""

    def openhosti_block(*args: Any) -> Any:
        return fn(*args)

    return jax.jit(openhosti_block)


@functools.cache
def _marked_class(cls: type) -> type:
    base_call = cls.__call__

    def __call__(self: Any, x: Any, *rest: Any, **kwargs: Any) -> Any:
        graphdef, state = nnx.split(self)

        def run(state: Any, x: Any) -> Any:
            return base_call(nnx.merge(graphdef, state), x, *rest, **kwargs)

        return marked_call(run)(state, x)

    return type(
        cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )


def mark_nnx(module: nnx.Module) -> int:
    """Make every repeated block of ``module`` (in place: call it on a copy) run as one named call of the traced
    program (the block's first argument is its input; state changes inside it are not kept); return how many."""
    blocks = [b for _, b in nnx_blocks(module) if not _stacked(b)]
    for block in blocks:
        block.__class__ = _marked_class(type(block))
    return len(blocks)


@contextlib.contextmanager
def mark_linen(block_paths: set[tuple[str, ...]]) -> Iterator[None]:
    """Within the block, linen modules at ``block_paths`` run ``__call__`` as one named call of the traced
    program."""

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        if context.method_name != "__call__" or tuple(context.module.path) not in block_paths or not args:
            return next_fun(*args, **kwargs)
        first, rest = args[0], args[1:]
        return marked_call(lambda x: next_fun(x, *rest, **kwargs))(first)

    with linen.intercept_methods(interceptor):
        yield
