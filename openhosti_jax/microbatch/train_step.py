"""A train step that accumulates gradients over microbatches, then applies them once.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.state import TrainState
    >>> from openhosti_jax.microbatch import make_train_step
    >>> def loss_fn(p, mb, rng):
    ...     return jnp.sum((mb["x"] * p["w"] - mb["y"]) ** 2), mb["x"].shape[0]
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.float32(0.0)}, tx=optax.sgd(0.1),
    ...                           rng=jax.random.key(0))
    >>> step = jax.jit(make_train_step(loss_fn, num_microbatches=2))
    >>> state, metrics = step(state, {"x": jnp.ones(4), "y": jnp.ones(4)})
    >>> int(state.step), round(float(state.params["w"]), 3)
    (1, 0.2)
"""

from __future__ import annotations

from typing import Any

import optax
from jax.sharding import NamedSharding

from openhosti_jax.microbatch.accumulate import accumulate_gradients
from openhosti_jax.state.context import current_microbatches
from openhosti_jax.state.contracts import LossFn, StepFn


def make_train_step(
    loss_fn: LossFn,
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
    passes ``rng=None`` to ``loss_fn``). The step is not jitted: wrap it in ``jax.jit`` (donating the state)
    or ``@spmd``.
    Metrics: ``loss`` (mean over real samples), ``num_real``, ``grad_norm`` and ``aux`` with ``has_aux``.
    """

    def train_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        rng = None
        if hasattr(state, "next_rng"):
            state, rng = state.next_rng()
        _, grads, metrics = accumulate_gradients(
            loss_fn,
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
        return state.apply_gradients(grads=grads), metrics

    return train_step
