"""A train step that accumulates gradients over microbatches, then applies them once.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.state import TrainState
    >>> from openhosti_jax.microbatch import make_train_step
    >>> def loss_sum_fn(p, mb, rng):
    ...     return jnp.sum((mb["x"] * p["w"] - mb["y"]) ** 2), mb["x"].shape[0]
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.float32(0.0)}, tx=optax.sgd(0.1),
    ...                           rng=jax.random.key(0))
    >>> step = jax.jit(make_train_step(loss_sum_fn, num_microbatches=2))
    >>> state, metrics = step(state, {"x": jnp.ones(4), "y": jnp.ones(4)})
    >>> int(state.step), round(float(state.params["w"]), 3)
    (1, 0.2)
"""

from __future__ import annotations

from typing import Any

import optax
from jax.sharding import NamedSharding

from openhosti_jax.microbatch.accumulate import accumulate_gradients
from openhosti_jax.policies.optimizers import find_loss_scale
from openhosti_jax.state.context import current_microbatches, mark_loss_scaled
from openhosti_jax.state.contracts import StepFn, SummedLossFn


def make_train_step(
    loss_sum_fn: SummedLossFn,
    num_microbatches: int | None = None,
    *,
    has_aux: bool = False,
    accum_sharding: Any = None,
    microbatch_sharding: NamedSharding | None = None,
    mask_key: str = "mask",
) -> StepFn:
    """``train_step(state, batch) -> (state, metrics)`` over ``num_microbatches`` accumulated microbatches.

    ``num_microbatches=None`` takes the count chosen by the enclosing ``@spmd(microbatch=...)`` step (1 outside).

    ``state`` is an `openhosti_jax.state.TrainState` (or any flax TrainState; one without an ``rng`` field
    passes ``rng=None`` to ``loss_sum_fn``). The step is not jitted: wrap it in ``jax.jit`` (donating the state)
    or ``@spmd``.
    Metrics: ``loss`` (mean over real samples), ``num_real``, ``grad_norm`` and ``aux`` with ``has_aux``.

    When the optimizer scales the loss (`openhosti_jax.policies.optimizers.dynamic_loss_scale`, the ``fp16``
    precision), the loss is multiplied by the current scale before differentiation, the optimizer unscales the
    gradients and skips a step whose gradients are not finite, and the metrics add ``loss_scale`` and
    ``skipped_steps`` (the running count); ``loss`` and ``grad_norm`` are reported unscaled.
    """

    def train_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        rng = None
        if hasattr(state, "next_rng"):
            state, rng = state.next_rng()
        scaling = find_loss_scale(getattr(state, "opt_state", None))
        scale = None if scaling is None else scaling.scale
        objective = loss_sum_fn
        if scale is not None:
            mark_loss_scaled()

            def objective(p: Any, mb: Any, r: Any) -> Any:
                loss_sum, rest = loss_sum_fn(p, mb, r)
                return loss_sum * scale, rest

        _, grads, metrics = accumulate_gradients(
            objective,
            state.params,
            batch,
            current_microbatches() if num_microbatches is None else num_microbatches,
            rng,
            has_aux=has_aux,
            accum_sharding=accum_sharding,
            microbatch_sharding=microbatch_sharding,
            mask_key=mask_key,
        )
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        if scale is None:
            return state.apply_gradients(grads=grads), metrics
        metrics.update(loss=metrics["loss"] / scale, grad_norm=metrics["grad_norm"] / scale, loss_scale=scale)
        new_state = state.apply_gradients(grads=grads)
        return new_state, dict(metrics, skipped_steps=find_loss_scale(new_state.opt_state).skipped)

    return train_step
