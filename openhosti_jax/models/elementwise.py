"""Activations and norms whose backward keeps only their inputs.

Reverse-mode autodiff of ``silu(gate) * up`` keeps the sigmoid, its argument and more for the backward: four copies
of the MLP's widest activation where the two inputs suffice. A norm computed in float32 keeps a float32 copy of its
input and its normalised output besides. Megatron's fused SwiGLU and Transformer Engine's fused norms keep their
inputs and recompute the rest in the backward; `recomputed` does the same for any elementwise function, with
`jax.checkpoint`: its inputs are its only residuals and its elementwise work runs again in the backward (memory
bound, a few reads of the inputs). XLA's fusion already recomputes some such chains instead of storing them (a
LayerNorm's in float32: the same compiled bytes either way), not all: a bf16 Llama block's compiled gradient holds
22% less with `swiglu` and `rms_norm` (``tests/test_models_elementwise.py`` compiles both). The bundled models call
their activations through these functions, Llama its norm too, so what they hold for the backward, and what the
planner prices by tracing them, is what fused kernels hold.

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
import jax.numpy as jnp

F = TypeVar("F", bound=Callable[..., Any])


def recomputed(fn: F) -> F:
    """``fn`` (a function of arrays, elementwise or row-wise) whose backward keeps only its inputs and runs ``fn``
    again for the rest; the same values and gradients as ``fn``."""
    return functools.wraps(fn)(jax.checkpoint(fn))  # type: ignore[return-value]


@recomputed
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` (the SwiGLU MLP's hidden activation), keeping ``gate`` and ``up`` for the backward."""
    return jax.nn.silu(gate) * up


def gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
    """`jax.nn.gelu` (``approximate``: the tanh form, else the exact erf one), keeping ``x`` for the backward."""
    return recomputed(functools.partial(jax.nn.gelu, approximate=approximate))(x)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last axis, the statistics in float32 and the result in
    ``dtype``, keeping ``x`` and ``weight`` for the backward (not a float32 copy of ``x`` or the result).

    >>> x = jnp.array([[3.0, 4.0]])
    >>> [round(v, 4) for v in rms_norm(x, jnp.ones((2,)), 0.0, jnp.float32)[0].tolist()]  # x / sqrt(12.5)
    [0.8485, 1.1314]
    """

    def norm(x: jax.Array, weight: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return y.astype(dtype) * weight.astype(dtype)

    return recomputed(norm)(x, weight)
