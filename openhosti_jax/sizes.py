"""Sizes of things: the divisors of a count, and the bytes of an array, an abstract array or a pytree of them.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.sizes import divisors, tree_bytes
    >>> divisors(12)
    (1, 2, 3, 4, 6, 12)
    >>> tree_bytes({"w": jax.ShapeDtypeStruct((3, 4), jnp.float32), "b": jnp.zeros(4, jnp.bfloat16)})
    56
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (numpy dtypes, scalar types such as ``jnp.float32``, and JAX key dtypes)."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys) are not numpy dtypes but know their size
        return int(dtype.itemsize)


def nbytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of an array of ``shape`` and ``dtype``."""
    return math.prod(shape) * itemsize(dtype)


def leaf_bytes(x: Any) -> int:
    """Bytes of an array, a `jax.ShapeDtypeStruct` or a jaxpr variable's abstract value (``x.aval``)."""
    aval = getattr(x, "aval", x)
    return nbytes(aval.shape, aval.dtype)


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays (or abstract arrays) in a pytree."""
    return sum(leaf_bytes(x) for x in jax.tree.leaves(tree))
