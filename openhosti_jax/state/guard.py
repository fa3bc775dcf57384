"""Skip non-finite updates inside the step: a step whose loss, gradient norm or new parameters are not finite
leaves the whole state as it was, as if its batch had never been seen.

Like ``optax.apply_if_finite``, but over any state and any optimizer: the check reads the step's ``loss`` and
``grad_norm`` metrics (scalars, free) and, when the step reports no ``grad_norm``, every new floating-point
parameter (a NaN or Inf gradient reaches them through any optimizer). Selecting the old state restores the step
counter, the optimizer moments and the random key too, so the next step runs exactly as it would have without the
bad batch. The metrics gain ``skipped_nonfinite`` (1 for a skipped step, else 0).

Example:
    >>> import jax.numpy as jnp
    >>> from openhosti_jax.state.guard import skip_nonfinite
    >>> old = {"w": jnp.ones(2), "step": jnp.int32(3)}
    >>> new = {"w": jnp.array([jnp.nan, 0.0]), "step": jnp.int32(4)}
    >>> state, metrics = skip_nonfinite(old, new, {"loss": jnp.float32(1.0)}, params=lambda s: s["w"])
    >>> state["w"].tolist(), int(state["step"]), int(metrics["skipped_nonfinite"])
    ([1.0, 1.0], 3, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

CHECKED_METRICS = ("loss", "grad_norm")
"""The metrics whose finiteness decides a step (when the step reports them)."""


def _all_finite(x: Any) -> jax.Array:
    return jnp.all(jnp.isfinite(x))


def skip_nonfinite(old: Any, new: Any, metrics: Any, *, params: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(``new`` where the step is finite, else ``old``; metrics with ``skipped_nonfinite`` when they are a dict).

    ``params(state)`` gives the parameters inside a state; they are checked only when ``metrics`` has no
    ``grad_norm``. Traced inside the jitted step: the select fuses with the update, the check is a reduction.
    """
    named = metrics if isinstance(metrics, dict) else {}
    checks = [
        _all_finite(named[k])
        for k in CHECKED_METRICS
        if k in named and jnp.issubdtype(jnp.result_type(named[k]), jnp.inexact)
    ]
    if "grad_norm" not in named:
        checks += [
            _all_finite(p) for p in jax.tree.leaves(params(new)) if jnp.issubdtype(jnp.result_type(p), jnp.inexact)
        ]
    if not checks:
        return new, metrics
    ok = jnp.all(jnp.stack(checks))
    state = jax.tree.map(lambda n, o: jax.lax.select(ok, n, o), new, old)
    if isinstance(metrics, dict):
        metrics = {**metrics, "skipped_nonfinite": jnp.logical_not(ok).astype(jnp.int32)}
    return state, metrics
