"""Skip non-finite updates: a step whose gradients (or loss) are not finite leaves the state as it was, as if its
batch had never been seen.

Two ways, chosen by the ``@spmd`` core (`openhosti_jax.state.jit.jit_step`):

- the library's `TrainState` guards its own update: ``apply_gradients`` runs the optimizer under a ``lax.cond`` on
  the gradients' finiteness, so the donated state is still updated in place (no second copy of it is kept); then
  `after_guarded_update` also restores the random key and the model state (batch statistics) of a skipped step;
- any other state (a ``(params, opt_state)`` tuple, flax's TrainState, an ``nnx.Optimizer``) gets `skip_nonfinite`:
  the step's ``loss`` and ``grad_norm`` metrics (and, without ``grad_norm``, every new parameter: a NaN gradient
  reaches them through any optimizer) decide, and a select keeps the old state. That select keeps the old and the
  new state alive together, so it costs temporaries of about the parameters' size.

Either way the metrics gain ``skipped_nonfinite`` (1 for a skipped step, else 0).

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


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def all_finite(tree: Any) -> jax.Array:
    """True when every floating-point value in ``tree`` is finite (a traced scalar bool)."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _inexact(x)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def _with_flag(metrics: Any, skipped: jax.Array) -> Any:
    if isinstance(metrics, dict):
        return {**metrics, "skipped_nonfinite": skipped.astype(jnp.int32)}
    return metrics


def skip_nonfinite(old: Any, new: Any, metrics: Any, *, params: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(``new`` where the step is finite, else ``old``; metrics with ``skipped_nonfinite`` when they are a dict).

    ``params(state)`` gives the parameters inside a state; they are checked only when ``metrics`` has no
    ``grad_norm``. Traced inside the jitted step.
    """
    named = metrics if isinstance(metrics, dict) else {}
    checked = {k: named[k] for k in CHECKED_METRICS if k in named}
    if "grad_norm" not in named:
        checked["params"] = params(new)
    ok = all_finite(checked)
    state = jax.tree.map(lambda n, o: jax.lax.select(ok, n, o), new, old)
    return state, _with_flag(metrics, jnp.logical_not(ok))


def after_guarded_update(old: Any, new: Any, metrics: Any) -> tuple[Any, Any]:
    """For a `TrainState` whose ``apply_gradients`` skipped a non-finite update (its ``step`` did not advance):
    the old random key and model state back, and ``skipped_nonfinite`` in the metrics."""
    skipped = new.step == old.step
    back = lambda n, o: jax.lax.select(skipped, o, n)  # noqa: E731
    new = new.replace(rng=back(new.rng, old.rng), model_state=jax.tree.map(back, new.model_state, old.model_state))
    return new, _with_flag(metrics, skipped)
