"""Elementwise pieces whose backward keeps only their inputs.

Reverse-mode autodiff of ``silu(gate) * up`` keeps the sigmoid, its argument and more for the backward: four copies
of the MLP's widest activation where the two inputs suffice, and a float32 cast of a bf16 value keeps the float32
copy. Megatron's fused SwiGLU keeps its inputs and recomputes the rest in the backward; `recomputed` does the same
for any function of arrays, with `jax.checkpoint`: its inputs are its only residuals and its elementwise work runs
again in the backward (memory bound, a few reads of the inputs).

The mixture-of-experts block (`openhosti_jax.models.moe`) runs its experts' SwiGLU, its router's float32 logits and
its float32 combine through them: a Mixtral layer held 121 s*h bytes per sequence for the backward, 65 with them
(`tests/test_models_elementwise.py` compiles a scanned MoE Llama both ways). The dense models do not: in their
straight-line parts XLA's fusion already recomputes such chains, which the planner's residual trace does not model,
so its memory predictions for them (checked against compiled steps within 10%) would drift.

Example:
    >>> import jax, jax.numpy as jnp
    >>> g, u = jnp.linspace(-2.0, 2.0, 8), jnp.linspace(1.0, 3.0, 8)
    >>> plain = lambda g, u: jnp.sum(jax.nn.silu(g) * u)
    >>> lean = lambda g, u: jnp.sum(swiglu(g, u))
    >>> all(bool(jnp.allclose(a, b)) for a, b in zip(jax.grad(plain, (0, 1))(g, u), jax.grad(lean, (0, 1))(g, u)))
    True
    >>> from jax.ad_checkpoint import print_saved_residuals
    >>> print_saved_residuals(lean, g, u)  # the two inputs, nothing computed from them
    f32[8] from the argument g
    f32[8] from the argument u
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])


def recomputed(fn: F) -> F:
    """``fn`` (a function of arrays, elementwise or row-wise) whose backward keeps only its inputs and runs ``fn``
    again for the rest; the same values and gradients as ``fn``."""
    return functools.wraps(fn)(jax.checkpoint(fn))  # type: ignore[return-value]


@recomputed
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` (the SwiGLU MLP's hidden activation), keeping ``gate`` and ``up`` for the backward."""
    return jax.nn.silu(gate) * up
