"""Where a training state keeps its parameters and its optimizer state, found in any pytree.

A state is whatever a user's step takes first: the library's `TrainState`, a ``flax.training`` TrainState subclass
(with ``batch_stats``, a dropout key, an EMA copy), a plain ``(params, opt_state)`` tuple or dict, or the
``nnx.split((model, optimizer))`` state of an nnx model and `nnx.Optimizer`. `find_layout` locates, in order:

1. the nodes named by the caller (``params="0"``, ``opt_state="1"``: dotted pytree paths);
2. the nodes named ``params`` and ``opt_state`` (flax's and the library's TrainState, dicts);
3. the optimizer's mirror: optax keeps moments (Adam's ``mu`` / ``nu``, momentum's ``trace``) with the parameters'
   structure and shapes, so the largest subtree whose floating leaves reappear, path for path and shape for shape,
   in a disjoint subtree holds the parameters, and the other branch holds the optimizer state. Where the parameters
   share a node with other floating leaves (nnx batch statistics), only the mirrored leaves are parameters;
4. otherwise, the smallest subtree holding every floating-point leaf (a stateless optimizer such as plain SGD).

Every other leaf (step counters, PRNG keys, batch statistics) is replicated, except leaves of a subtree that mirrors
the parameters (an EMA copy), which are placed like the parameters.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from openhosti_jax.state.layout import find_layout
    >>> params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    >>> layout = find_layout((params, optax.adam(1e-3).init(params)))
    >>> layout.describe()
    'parameters at state[0], optimizer state at state[1]'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from openhosti_jax.errors import StateError
from openhosti_jax.sharding.specs import is_spec
from openhosti_jax.sharding.zero import mirror_specs
from openhosti_jax.sizes import leaf_bytes

Path = tuple[Any, ...]
"""A pytree key path (`jax.tree_util` key entries)."""


def path_name(path: Path) -> str:
    """``path`` as a dotted name: ``"params"``, ``"0"``, ``"1.opt_state"`` (``""`` for the root)."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def subtree(tree: Any, path: Path) -> Any:
    """The node of ``tree`` at ``path``."""
    node = tree
    for key in path:
        children, _ = jax.tree_util.flatten_one_level_with_keys(node)
        node = next(child for k, child in children if k == key)
    return node


def _within(path: Path, prefix: Path) -> bool:
    return path[: len(prefix)] == prefix


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where the parameters and the optimizer state of a state pytree are."""

    params_path: Path
    """The node holding the parameters."""
    param_rels: frozenset[Path] | None = None
    """Paths (relative to ``params_path``) of the leaves that are parameters; None: every floating leaf there."""
    opt_path: Path | None = None
    """The node holding the optimizer state, if any."""

    def is_param(self, path: Path, leaf: Any) -> bool:
        """Whether the state leaf at ``path`` is a parameter."""
        if not _within(path, self.params_path) or not _is_float(leaf):
            return False
        return self.param_rels is None or path[len(self.params_path) :] in self.param_rels

    def params(self, state: Any) -> Any:
        """The parameters as a pytree: the params node, with non-parameter leaves removed (set to None)."""
        node = subtree(state, self.params_path)
        base = self.params_path
        return jax.tree_util.tree_map_with_path(lambda p, x: x if self.is_param(base + tuple(p), x) else None, node)

    def opt_state(self, state: Any) -> Any:
        """The optimizer-state node (None when the state has none)."""
        return None if self.opt_path is None else subtree(state, self.opt_path)

    def specs(self, state: Any, param_specs: Any, opt_specs: Any) -> Any:
        """PartitionSpecs for every leaf of ``state``: ``param_specs`` (a tree like `params`) on the parameters and
        on any leaf that mirrors one (an EMA copy: the same relative path and shape), ``opt_specs`` (a tree like
        `opt_state`) on the optimizer state, every other leaf replicated."""
        specs = mirror_specs(state, self.params(state), param_specs)
        if self.opt_path is None:
            return specs
        flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
        opt = iter(jax.tree.leaves(opt_specs, is_leaf=is_spec))
        leaves = [next(opt) if _within(tuple(p), self.opt_path) else s for p, s in flat]
        return jax.tree.unflatten(treedef, leaves)

    def describe(self, where: Callable[[Path], str] | None = None) -> str:
        """One line naming both places; ``where(path)`` names a path (default ``state`` + its key string)."""
        name = where or (lambda p: f"state{jax.tree_util.keystr(p)}")
        found = f"parameters at {name(self.params_path)}"
        if self.param_rels is not None:
            found += " (the floating leaves the optimizer mirrors)"
        if self.opt_path is None:
            return f"{found}, no optimizer state"
        return f"{found}, optimizer state at {name(self.opt_path)}"


def _signatures(leaves: list[tuple[Path, Any]]) -> tuple[dict[Path, dict[Path, tuple]], dict[Path, list[Path]]]:
    """Per node, ``{relative path: shape}`` of its floating leaves; per relative path, the nodes that have it."""
    sig: dict[Path, dict[Path, tuple]] = {}
    holders: dict[Path, list[Path]] = {}
    for path, leaf in leaves:
        if not _is_float(leaf):
            continue
        for k in range(len(path)):
            node, rel = path[:k], path[k:]
            sig.setdefault(node, {})[rel] = tuple(leaf.shape)
            holders.setdefault(rel, []).append(node)
    return sig, holders


def _mirrors_of(node: Path, sig: dict, holders: dict) -> Iterator[Path]:
    """Nodes disjoint from ``node`` holding every floating leaf of ``node`` at the same relative path and shape."""
    mine = sig[node]
    first = next(iter(mine))
    for other in holders[first]:
        if _within(other, node) or _within(node, other):
            continue
        theirs = sig[other]
        if all(theirs.get(rel) == shape for rel, shape in mine.items()):
            yield other


def _branch(path: Path, depth: int) -> Path:
    return path[: depth + 1]


def _by_mirror(leaves: list[tuple[Path, Any]], opt_named: Path | None, arguments: bool = False) -> StateLayout | None:
    """The parameters as the largest node an optimizer mirrors (module docstring, rule 3); with ``arguments`` the
    state's top-level entries are separate step arguments, and only the parameters' own one weighs against them."""
    sig, holders = _signatures(leaves)
    nbytes = {p: leaf_bytes(x) for p, x in leaves if _is_float(x)}
    for node in sorted((n for n in sig if n), key=lambda n: (-len(sig[n]), len(n))):
        mirrors = list(_mirrors_of(node, sig, holders))
        if not mirrors:
            continue
        mirror = min(mirrors, key=lambda m: len(_common(node, m)))
        depth = len(_common(node, mirror))
        x, y = _branch(node, depth), _branch(mirror, depth)
        copies = [node, *mirrors]
        if _optimizer_side(x, y, copies, leaves, opt_named) == x:
            node, x, y = mirror, y, x
        rels = frozenset(sig[copies[0]])  # the mirrored leaves, at the same relative paths in every copy
        mirrored = sum(nbytes[node + rel] for rel in rels)
        own = node[:1] if arguments else ()
        if 2 * mirrored < sum(b for p, b in nbytes.items() if not _within(p, y) and _within(p, own)):
            return None  # look-alike blocks inside a bigger model (layer 0 and layer 1), not an optimizer's moments
        return StateLayout(node, None if rels == frozenset(sig[node]) else rels, y)
    return None


def _optimizer_side(x: Path, y: Path, copies: list[Path], leaves: list[tuple[Path, Any]], named: Path | None) -> Path:
    """Which of two branches holding copies of the same leaves is the optimizer's: the one holding the node named
    ``opt_state``; else the one with more copies (Adam's ``mu`` and ``nu``); else the one whose floating leaves
    are all copies (momenta, where the model's side also has batch statistics); else the one with an integer
    counter (optax's ``count``); else the later one (``(params, opt_state)``, as optax's examples write it)."""
    if named is not None:
        for side in (x, y):
            if _within(named, side) or _within(side, named):
                return side
    count = {side: sum(1 for c in copies if _within(c, side)) for side in (x, y)}
    if count[x] != count[y]:
        return x if count[x] > count[y] else y
    floats = [p for p, leaf in leaves if _is_float(leaf)]
    extra = {side: any(_within(p, side) and not any(_within(p, c) for c in copies) for p in floats) for side in (x, y)}
    if extra[x] != extra[y]:
        return y if extra[x] else x
    ints = {side: any(_within(p, side) and not _is_float(leaf) for p, leaf in leaves) for side in (x, y)}
    if ints[x] != ints[y]:
        return x if ints[x] else y
    order = [p for p, _ in leaves]
    return max(x, y, key=lambda side: next(i for i, p in enumerate(order) if _within(p, side)))


def _common(a: Path, b: Path) -> Path:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _named(prefixes: set[Path], name: str) -> Path | None:
    found = sorted((p for p in prefixes if p and _key_name(p[-1]) == name), key=len)
    return found[0] if found else None


def _lookup(names: dict[str, Path], name: str, what: str) -> Path:
    if name not in names:
        shown = sorted(n for n in names if n.count(".") < 2)[:20]
        raise StateError(
            f"{what}={name!r} names no node of the state; expected a dotted path such as {shown}; "
            "print jax.tree_util.tree_flatten_with_path(state) to see every path"
        )
    return names[name]


def _leaves_and_names(state: Any) -> tuple[list[tuple[Path, Any]], set[Path], dict[str, Path]]:
    leaves = [(tuple(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]
    prefixes = {p[:k] for p, _ in leaves for k in range(len(p) + 1)}
    return leaves, prefixes, {path_name(p): p for p in prefixes}


def find_layout(
    state: Any, *, params: str | None = None, opt_state: str | None = None, arguments: bool = False
) -> StateLayout:
    """The `StateLayout` of ``state`` (see the module docstring); ``params`` / ``opt_state`` are dotted paths
    (`path_name`) that override the search for unusual layouts. ``arguments``: the state's top-level entries are a
    step's separate arguments (the data among them does not count as model).

    Raises `StateError` when the state has no floating-point leaf to train, or an override names no node.
    """
    leaves, prefixes, names = _leaves_and_names(state)
    if not any(_is_float(x) for _, x in leaves):
        found = sorted({type(x).__name__ for _, x in leaves}) or ["no leaves"]
        raise StateError(
            f"the state has no floating-point leaves to train (found {', '.join(found)}); pass the parameters "
            "in the step's first argument, e.g. step((params, opt_state), batch)"
        )
    if params is not None:
        p_path = _lookup(names, params, "params")
        o_path = _lookup(names, opt_state, "opt_state") if opt_state is not None else _named(prefixes, "opt_state")
        if not any(_is_float(x) for p, x in leaves if _within(p, p_path)):
            raise StateError(f"params={params!r} holds no floating-point leaf; name the node with the parameters")
        return StateLayout(p_path, None, o_path)
    p_named, o_named = _named(prefixes, "params"), _named(prefixes, "opt_state")
    if opt_state is not None:
        o_named = _lookup(names, opt_state, "opt_state")
    if p_named is not None:
        return StateLayout(p_named, None, o_named)
    found = _by_mirror(leaves, o_named, arguments)
    if found is not None:
        return found if o_named is None else dataclasses.replace(found, opt_path=o_named)
    floating = [p for p, x in leaves if _is_float(x)]
    common = floating[0]
    for p in floating[1:]:
        common = _common(common, p)
    return StateLayout(common, None, o_named)


def layout_of_params(state: Any, param_leaves: Collection[Path], *, opt_state: str | None = None) -> StateLayout:
    """The layout whose parameters are exactly the leaves at ``param_leaves`` (nnx ``Param`` variables: no search
    needed). The optimizer state is the node named by ``opt_state`` (a dotted path), else the node named
    ``opt_state`` (an `nnx.Optimizer`'s), else the branch that mirrors the parameters (an optax state), else none.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> state = {"w": jnp.ones(2), "stats": jnp.zeros(2)}
        >>> path = jax.tree_util.tree_flatten_with_path(state)[0][1][0]
        >>> layout_of_params(state, [path]).describe()
        "parameters at state['w'], no optimizer state"
    """
    leaves, prefixes, names = _leaves_and_names(state)
    chosen = [tuple(p) for p in param_leaves]
    base = chosen[0]
    for p in chosen[1:]:
        base = _common(base, p)
    rels = frozenset(p[len(base) :] for p in chosen)
    floats = frozenset(p[len(base) :] for p, x in leaves if _within(p, base) and _is_float(x))
    if opt_state is not None:
        opt = _lookup(names, opt_state, "opt_state")
    else:
        opt = _named(prefixes, "opt_state")
    mirrored = _by_mirror(leaves, None, arguments=True) if opt is None else None
    if mirrored is not None and mirrored.opt_path is not None:  # an optimizer's mirror of these parameters
        ours = any(_within(p, mirrored.params_path) for p in chosen)
        if ours and not any(_within(p, mirrored.opt_path) for p in chosen):
            opt = mirrored.opt_path
    return StateLayout(base, None if rels == floats else rels, opt)


def step_of(state: Any) -> int | None:
    """The optimizer step a state has counted: its ``step`` field (flax's and the library's TrainState, an
    `nnx.Optimizer`), else optax's ``count``, else None (a plain state whose optimizer counts nothing).

    Example:
        >>> import jax.numpy as jnp, optax
        >>> params = {"w": jnp.ones(2)}
        >>> step_of((params, optax.adam(0.1).init(params))), step_of((params, optax.sgd(0.1).init(params)))
        (0, None)
    """
    step = getattr(state, "step", None)
    if step is not None and not callable(step):
        return int(step)
    leaves = [(tuple(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]
    for name in ("step", "count"):
        found = [(len(p), x) for p, x in leaves if p and _names(p, name)]
        if found:
            return int(min(found, key=lambda t: t[0])[1])
    return None


def _names(path: Path, name: str) -> bool:
    """Whether ``path`` ends with ``name`` (or ``name.value``, an nnx Variable)."""
    last = [_key_name(k) for k in path[-2:]]
    return last[-1] == name or last == [name, "value"]
