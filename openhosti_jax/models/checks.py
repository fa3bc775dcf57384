"""The checks model configs share: positive ints, finite numbers, floating dtypes. Each returns the problems it
finds as sentences (a config reports all of them at once in one `openhosti_jax.errors.ConfigError`).

Example:
    >>> positive_ints({"layers": 0, "width": 64}, ("layers", "width"))
    ({'layers'}, ['layers=0 must be a positive int'])
    >>> finite_number("eps", -1.0, minimum=0.0, strict=True), dtype_problem("int8")
    ('eps=-1.0 must be a positive finite number', "dtype='int8' must be a floating dtype")
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp


def positive_ints(values: Mapping[str, Any], names: Iterable[str]) -> tuple[set[str], list[str]]:
    """(the names whose value is not an int >= 1 (bools are not ints here), one sentence each)."""
    names = list(names)
    bad = {k for k in names if not isinstance(values[k], int) or isinstance(values[k], bool) or values[k] < 1}
    return bad, [f"{k}={values[k]!r} must be a positive int" for k in names if k in bad]


def finite_number(name: str, value: Any, *, minimum: float, strict: bool) -> str | None:
    """The problem of ``value`` as a finite number above ``minimum`` (``strict``: ``>``; else ``>=``), or None."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > minimum if strict else value >= minimum)
    )
    if ok:
        return None
    if minimum == 0 and strict:
        return f"{name}={value!r} must be a positive finite number"
    return f"{name}={value!r} must be a finite number {'>' if strict else '>='} {minimum:g}"


def dtype_problem(dtype: Any) -> str | None:
    """The problem of ``dtype`` as a floating compute dtype, or None."""
    try:
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            return f"dtype={dtype!r} must be a floating dtype"
    except TypeError:
        return f"dtype={dtype!r} is not a dtype name (e.g. 'float32', 'bfloat16')"
    return None
