"""The one FLOP counter: FLOPs of a jaxpr, read from its equations, nothing compiled.

A ``dot_general`` costs ``2 x output size x contracted size``, a grouped matmul (``ragged_dot_general``, what
`jax.lax.ragged_dot` and its transposes trace to) ``2 x lhs size x the rhs's free dims`` (``2 m k n`` for lhs
``(m, k)`` and rhs ``(groups, k, n)``: each row meets one group), a convolution ``2 x output size x kernel window x
input features``; with ``matmul_only=False`` every other primitive costs one FLOP per output element. Nested jaxprs
count by the one rule of `openhosti_jax.jaxpr_walk`: a ``scan`` body once per trip, of a ``cond`` / ``switch`` only
the most expensive branch (one branch runs), a ``while`` predicate and body once each (the trip count is not known
from shapes), other calls (``jit``, ``remat``, ``custom_vjp``) once.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.flops import jaxpr_flops
    >>> jaxpr_flops(lambda a, b: a @ b, jnp.ones((2, 8)), jnp.ones((8, 4)))
    128.0
    >>> pick = lambda p, a: jax.lax.cond(p, lambda x: x @ x, lambda x: x, a)
    >>> jaxpr_flops(pick, True, jnp.ones((4, 4)), matmul_only=True)  # the matmul branch, not both
    128.0
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from openhosti_jax.jaxpr_walk import calls

CAUSAL_ATTENTION_COUNTED = 0.5
"""The share of a causal attention layer's ``seq x seq`` score and weighted-value matmuls that *model* FLOPs (what
MFU counts) count: half, the (query, key) pairs a query may attend (key index <= query index). MaxText counts so
(src/maxtext/utils/maxtext_utils.py @ e591f30, ``calculate_tflops_training_per_device``: "Divide attention flops
by 2 due to causal mask", since AI-Hypercomputer/maxtext#1988; docs/reference/performance_metrics.md, "Causal
attention"), and so does Megatron-LM (megatron/training/training.py @ d98e8a6, ``num_floating_point_operations``:
"/ 2  # causal mask (only half of the mask is non-zero)"); torchtitan counts the whole square
(torchtitan/models/utils.py @ b5bcd76, ``get_dense_model_nparams_and_flops``: "we follow the convention and do not
account for sparsity in causal attention"). Only the utilisation's numerator follows it: a step's *time* prices the
work its kernels do (a flash kernel skips the masked blocks, a plain one computes and masks them).
A bidirectional layer (BERT's encoder, a UNet's) counts its whole square."""


def dot_flops(eqn: Any) -> float:
    """FLOPs of one ``dot_general`` equation (2 x contracted size x output size)."""
    (lc, _), _ = eqn.params["dimension_numbers"]
    k = math.prod(eqn.invars[0].aval.shape[d] for d in lc)
    return 2.0 * k * math.prod(eqn.outvars[0].aval.shape)


def ragged_dot_flops(eqn: Any) -> float:
    """FLOPs of one ``ragged_dot_general`` equation: 2 x the lhs's size x the rhs dims that are neither contracted,
    batch nor group dims (each lhs row is multiplied by its own group's matrix only).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x, w: jax.lax.ragged_dot(x, w, jnp.array([2, 6], jnp.int32))
    >>> ragged_dot_flops(jax.make_jaxpr(f)(jnp.ones((8, 4)), jnp.ones((2, 4, 3))).jaxpr.eqns[-1])  # 2 x 8 x 4 x 3
    192.0
    """
    nums = eqn.params["ragged_dot_dimension_numbers"]
    (_, rc), (_, rb) = nums.dot_dimension_numbers
    rhs = eqn.invars[1].aval.shape
    skip = {*rc, *rb, *nums.rhs_group_dimensions}
    free = math.prod(n for d, n in enumerate(rhs) if d not in skip)
    return 2.0 * math.prod(eqn.invars[0].aval.shape) * free


def ragged_groups(eqn: Any) -> int:
    """Groups of a ``ragged_dot_general`` equation (the length of its group sizes operand)."""
    return int(eqn.invars[2].aval.shape[-1])


def _conv_flops(eqn: Any) -> float:
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs) / max(out_features, 1)


def count_flops(jaxpr: Any, *, matmul_only: bool = False) -> float:
    """FLOPs of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``); ``matmul_only`` counts matmuls and convolutions."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    price = lambda j: count_flops(j, matmul_only=matmul_only)  # a cond's branch is chosen by what is counted
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inner = calls(eqn, price)
        if inner:
            total += sum(c.trips * price(c.jaxpr) for c in inner)
        elif name == "dot_general":
            total += dot_flops(eqn)
        elif name == "ragged_dot_general":
            total += ragged_dot_flops(eqn)
        elif name == "conv_general_dilated":
            total += _conv_flops(eqn)
        elif not matmul_only:
            total += sum(float(math.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
    return total


def matmul_flops(jaxpr: Any) -> float:
    """Matmul and convolution FLOPs of ``jaxpr``: what the planner prices, and so how it picks a ``cond`` branch."""
    return count_flops(jaxpr, matmul_only=True)


def jaxpr_flops(fn: Callable[..., Any], *args: Any, matmul_only: bool = False) -> float:
    """FLOPs of ``fn(*args)`` counted from its jaxpr (`count_flops`)."""
    return count_flops(jax.make_jaxpr(fn)(*args), matmul_only=matmul_only)
