"""The one rule for walking a jaxpr's nested calls: which jaxprs an equation runs, how many times, on which values.

Every recursive walk over a jaxpr (the FLOP counter `openhosti_jax.flops`, the planner's workload pricing and
sharding propagation, remat block counting) asks `calls` what an equation runs instead of reading primitives
itself. The rule:

- ``scan``: its body, once per trip (``length``); the scanned operands reach it one leading slice at a time and its
  stacked outputs leave it one slice per trip;
- ``cond`` / ``switch``: one branch runs, the costliest by the walker's own measure (``price``; the first of equal
  ones): a plan must fit and be priced for the branch that costs the most;
- ``while``: its predicate and its body, once each (the trip count is not known from shapes);
- anything else with nested jaxprs (``jit`` / ``pjit``, ``closed_call``, ``remat`` / ``checkpoint``,
  ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``, ...): each nested jaxpr once (a checkpointed call in
  the forward pass; `is_remat` tells a walker it is one, and its recomputation is the remat policy's business).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.jaxpr_walk import calls
    >>> f = lambda x: jax.lax.scan(lambda c, _: (c @ c, None), x, None, length=5)[0]
    >>> eqn = jax.make_jaxpr(f)(jnp.ones((2, 2))).jaxpr.eqns[0]
    >>> [(c.trips, len(c.jaxpr.eqns)) for c in calls(eqn, price=lambda j: 0.0)]
    [(5, 1)]
    >>> pick = lambda p, x: jax.lax.cond(p, lambda y: y @ y, lambda y: y, x)
    >>> eqn = jax.make_jaxpr(pick)(True, jnp.ones((2, 2))).jaxpr.eqns[-1]
    >>> [len(c.jaxpr.eqns) for c in calls(eqn, price=lambda j: len(j.eqns))]  # the branch with the matmul
    [1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

REMAT_PRIMITIVES = frozenset({"remat", "remat2", "checkpoint"})
"""Names of the checkpointed-call primitive across jax versions."""


class Call(NamedTuple):
    """One nested jaxpr an equation runs (`calls`)."""

    jaxpr: Any
    """The nested (open) ``Jaxpr``."""
    trips: int
    """How many times it runs per run of the equation."""
    operands: tuple[Any, ...] | None
    """The equation's values bound to ``jaxpr.invars``, in order; None where they do not line up one to one."""
    results: tuple[Any, ...] | None
    """The equation's outvars that ``jaxpr.outvars`` give, in order; None where it gives none of them (a while
    loop's predicate) or they do not line up."""
    sliced: int | None = None
    """``operands[sliced:]`` reach the jaxpr one leading slice per trip (a scan's ``xs``); None: whole."""
    stacked: int | None = None
    """``results[stacked:]`` stack the jaxpr's outputs over the trips (a scan's ``ys``); None: as given."""


def is_remat(eqn: Any) -> bool:
    """Whether ``eqn`` is a checkpointed call (``jax.checkpoint`` / ``jax.remat``)."""
    return eqn.primitive.name in REMAT_PRIMITIVES


def nested_jaxprs(eqn: Any) -> list[Any]:
    """Every (open) jaxpr in ``eqn``'s parameters, in parameter order (tuples of them, e.g. branches, flattened)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def _aligned(values: Sequence[Any], inner: Sequence[Any]) -> tuple[Any, ...] | None:
    return tuple(values) if len(values) == len(inner) else None


def calls(eqn: Any, price: Callable[[Any], float]) -> tuple[Call, ...]:
    """The nested jaxprs ``eqn`` runs by the rule of this module (empty for a plain primitive); ``price(jaxpr)``
    is the walker's cost of a branch, which picks the branch of a ``cond``."""
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        body = params["jaxpr"].jaxpr
        nc, nk = params["num_consts"], params["num_carry"]
        return (Call(body, int(params["length"]), tuple(eqn.invars), tuple(eqn.outvars), nc + nk, nk),)
    if name in ("cond", "switch"):
        branches = [getattr(b, "jaxpr", b) for b in params["branches"]]
        best = max(branches, key=price)
        return (Call(best, 1, _aligned(eqn.invars[1:], best.invars), _aligned(eqn.outvars, best.outvars)),)
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
        carry = eqn.invars[nc + nb :]
        return (
            Call(cond, 1, _aligned([*eqn.invars[:nc], *carry], cond.invars), None),
            Call(body, 1, _aligned(eqn.invars[nc:], body.invars), _aligned(eqn.outvars, body.outvars)),
        )
    subs = nested_jaxprs(eqn)
    if len(subs) == 1:
        sub = subs[0]
        operands, results = _aligned(eqn.invars, sub.invars), _aligned(eqn.outvars, sub.outvars)
        return (Call(sub, 1, operands, results if operands is not None else None),)
    return tuple(Call(sub, 1, None, None) for sub in subs)
