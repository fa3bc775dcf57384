"""Which saved activations and matmuls tensor parallelism splits: a sharding propagation over the step's jaxpr.

Parameters sharded over ``tensor`` mark one dim of their jaxpr input; the mark flows forward through
elementwise ops, broadcasts, reshapes, transposes, splits, reductions over other dims and matmuls (a marked
free or batch dim stays marked in the output; a matmul contracting marked dims on both sides ends in an
all-reduce and is unmarked), as XLA's sharding propagation does for Megatron-style layers. A residual whose
dim is marked is stored split over the tensor axis; a matmul with a marked operand is computed split, and its
unmarked operands are consumed whole (under sequence parallelism, the all-gathered input the backward reuses).
Nested jaxprs are followed by the one rule of `openhosti_jax.jaxpr_walk` (a scan's body per trip, its sliced
operands one dim in; a cond's costliest branch; a while's predicate and body once; any other call once), their
marks passed in and out where the walker lines their values up with the equation's. Anything the rules do not
know is treated as replicated (the conservative side for memory).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.planner.propagate import propagate
    >>> f = lambda w, x: jnp.tanh(x @ w)
    >>> j = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((2, 4)))
    >>> dims, split_flops, resharded, cut, whole = propagate(j.jaxpr, [1, None], 2)
    >>> dims[j.jaxpr.outvars[0]], split_flops, resharded, cut  # column-parallel: output features split, matmul split
    (1, 128.0, 0.0, 0)
    >>> j.jaxpr.invars[1] in whole  # the input x is consumed whole by the split matmul
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from jax.extend.core import Literal

from openhosti_jax.flops import dot_flops, matmul_flops, ragged_dot_flops
from openhosti_jax.jaxpr_walk import Call, calls
from openhosti_jax.sizes import leaf_bytes

Dim = int | None
"""The marked (tensor-split) dim of a value, or None when replicated."""

_SAME_SHAPE = frozenset(
    "add sub mul div neg exp log log1p expm1 tanh logistic sqrt rsqrt integer_pow pow max min abs sign select_n "
    "convert_element_type erf erfc erf_inv cos sin square eq ne lt le gt ge and or not stop_gradient "
    "copy copy_p clamp rem floor ceil round is_finite exp2 nextafter name".split()
)


def _reshape(d: int, old: Sequence[int], new: Sequence[int], t: int) -> Dim:
    """The new dim holding the outermost part of old dim ``d`` when it stays divisible by ``t``."""
    before = math.prod(old[:d])
    acc = 1
    for i, n in enumerate(new):
        if acc == before and n > 1:
            return i if n % t == 0 else None
        acc *= n
        if acc > before:
            return None
    return None


def _dot(eqn: Any, dl: Dim, dr: Dim) -> tuple[Dim, bool]:
    """(marked output dim, whether the matmul is computed split); a grouped matmul (``ragged_dot_general``) as a
    ``dot_general`` whose rhs group dim is neither free nor contracted (its output has no such dim)."""
    if eqn.primitive.name == "ragged_dot_general":
        nums = eqn.params["ragged_dot_dimension_numbers"]
        ((lc, rc), (lb, rb)), group = nums.dot_dimension_numbers, tuple(nums.rhs_group_dimensions)
    else:
        ((lc, rc), (lb, rb)), group = eqn.params["dimension_numbers"], ()
    lrank, rrank = (len(v.aval.shape) for v in eqn.invars[:2])
    lfree = [i for i in range(lrank) if i not in lc and i not in lb]
    rfree = [i for i in range(rrank) if i not in rc and i not in rb and i not in group]
    for d, batch, free, offset in ((dl, lb, lfree, len(lb)), (dr, rb, rfree, len(lb) + len(lfree))):
        if d is None:
            continue
        if d in batch:
            return list(batch).index(d), True
        if d in free:
            return offset + free.index(d), True
    both = dl is not None and dr is not None and dl in lc and dr in rc and lc.index(dl) == rc.index(dr)
    return None, both


def _out_dim(eqn: Any, dims: list[Dim], t: int) -> Dim:
    name, out = eqn.primitive.name, eqn.outvars[0].aval
    ins = [v.aval for v in eqn.invars]
    d = next((x for x in dims if x is not None), None)
    if d is None:
        return None
    src = ins[dims.index(d)]
    if name in _SAME_SHAPE:
        ok = len(out.shape) == len(src.shape) and out.shape[d] == src.shape[d]
        return d if ok else None
    if name == "broadcast_in_dim":
        return eqn.params["broadcast_dimensions"][d]
    if name == "reshape":
        return _reshape(d, src.shape, out.shape, t)
    if name == "transpose":
        return list(eqn.params["permutation"]).index(d)
    if name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
        axes = eqn.params["axes"]
        return None if d in axes else d - sum(a < d for a in axes)
    if name == "squeeze":
        dropped = eqn.params["dimensions"]
        return None if d in dropped else d - sum(a < d for a in dropped)
    if name in ("split", "slice", "dynamic_slice", "pad", "concatenate", "cumsum", "cumlogsumexp", "cummax"):
        return d if all(o.aval.shape[d] % t == 0 for o in eqn.outvars) else None
    return None


class Propagation(NamedTuple):
    """What a tensor split does to a jaxpr."""

    dims: dict[Any, Dim]
    """Marked dim of every value."""
    split_flops: float
    """FLOPs of the matmuls computed split."""
    resharded: float
    """Bytes of values whose mark an op cannot carry (gathered whole)."""
    cut_reshapes: int
    """Reshapes that cut a split dim into parts ``t`` does not divide (e.g. fewer attention heads than ``t``)."""
    whole: frozenset
    """Unmarked values a split matmul consumes: each device needs all of them (a sequence-split activation is
    all-gathered there, and XLA keeps the gathered copy for the backward)."""


def propagate(jaxpr: Any, in_dims: Sequence[Dim], t: int) -> Propagation:
    """How a tensor axis of size ``t`` splits ``jaxpr`` with ``in_dims`` marked on its invars.

    A value whose mark an op cannot carry (e.g. a reshape to heads that ``t`` does not divide) must be gathered
    whole: its full bytes count as resharded (XLA inserts all-gathers / all-to-alls there). Reductions over the
    marked dim are not counted (their small partial results are all-reduced)."""
    dims: dict[Any, Dim] = dict(zip(jaxpr.invars, in_dims, strict=True))
    splits, reshard, cut = 0.0, 0.0, 0
    whole: set[Any] = set()

    def get(v: Any) -> Dim:
        return None if isinstance(v, Literal) else dims.get(v)

    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        nested = calls(eqn, matmul_flops)
        if nested and all(call.operands is not None for call in nested):
            for call in nested:
                inner, n, r, c, w = propagate(call.jaxpr, _inner_dims(call, get), t)
                splits, reshard, cut = splits + n * call.trips, reshard + r * call.trips, cut + c
                whole |= _outer(call.results or (), call.jaxpr.outvars, w) | _outer(call.operands, call.jaxpr.invars, w)
                if call.results is not None:
                    dims.update(zip(call.results, _outer_dims(call, inner), strict=True))
            continue
        grouped = (
            eqn.primitive.name == "ragged_dot_general"
            and eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
        )  # the forward's grouped matmul (a transpose's ragged contraction stays unsplit)
        if eqn.primitive.name == "dot_general" or grouped:
            out, split = _dot(eqn, *ins[:2])
            dims[eqn.outvars[0]] = out
            flops = dot_flops(eqn) if eqn.primitive.name == "dot_general" else ragged_dot_flops(eqn)
            splits += flops if split else 0.0
            if split:
                whole.update(v for v, d in zip(eqn.invars[:2], ins[:2], strict=True) if d is None)
            continue
        if all(x is None for x in ins):
            continue
        for o in eqn.outvars:
            dims[o] = _out_dim(eqn, ins, t) if len(eqn.outvars) == 1 or eqn.primitive.name == "split" else None
        if all(dims[o] is None for o in eqn.outvars) and not eqn.primitive.name.startswith(("reduce_", "arg")):
            marked = next(v for v, d in zip(eqn.invars, ins, strict=True) if d is not None)
            reshard += leaf_bytes(marked)
            cut += eqn.primitive.name == "reshape"
    return Propagation(dims, splits, reshard, cut, frozenset(v for v in whole if not isinstance(v, Literal)))


def _inner_dims(call: Call, get: Callable[[Any], Dim]) -> list[Dim]:
    """The marks a nested jaxpr's invars start with: its operands', a scan's sliced ones less their scanned dim."""
    ins = [get(v) for v in call.operands]
    cut = len(ins) if call.sliced is None else call.sliced
    return [*ins[:cut], *(None if d in (None, 0) else d - 1 for d in ins[cut:])]


def _outer_dims(call: Call, inner: dict[Any, Dim]) -> list[Dim]:
    """The marks of a nested jaxpr's results as the equation gives them: a scan's stacked ones a dim later."""
    outs = [None if isinstance(v, Literal) else inner.get(v) for v in call.jaxpr.outvars]
    keep = len(outs) if call.stacked is None else call.stacked
    return [d if i < keep or d is None else d + 1 for i, d in enumerate(outs)]


def _outer(outer: Sequence[Any], inner: Sequence[Any], whole: frozenset) -> set[Any]:
    """The values of ``outer`` whose counterparts in a sub-jaxpr's ``inner`` are consumed whole."""
    return {o for o, i in zip(outer, inner, strict=False) if not isinstance(i, Literal) and i in whole}
