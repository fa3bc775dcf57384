"""`TrainState`: flax's TrainState plus a PRNG key, so dropout and sampling resume exactly.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.state import TrainState
    >>> s = TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1),
    ...                       rng=jax.random.key(0))
    >>> int(s.step)
    0
"""

from __future__ import annotations

from typing import Any

import jax
from flax.training import train_state

from openhosti_jax.state.context import constrain_gradients, current_update_guard
from openhosti_jax.state.guard import all_finite


class TrainState(train_state.TrainState):
    """A `flax.training.train_state.TrainState` with a ``rng`` key that is split every step by `next_rng`.

    ``apply_gradients`` constrains the gradients to the active plan's gradient shardings (ZeRO-2/3
    reduce-scatter) when called inside an ``@openhosti_jax.spmd`` step, and there (unless
    ``spmd(skip_nonfinite=False)``) leaves the state as it was when the gradients are not finite.
    """

    rng: jax.Array
    model_state: Any = None
    """Non-parameter model variables (nnx non-Param state, linen batch stats); not touched by the optimizer."""

    def apply_gradients(self, *, grads, **kwargs) -> TrainState:
        grads = constrain_gradients(grads)
        guard = current_update_guard()
        if guard is None:
            return super().apply_gradients(grads=grads, **kwargs)
        guard.used = True
        update = lambda s, g: train_state.TrainState.apply_gradients(s, grads=g, **kwargs)  # noqa: E731
        return jax.lax.cond(all_finite(grads), update, lambda s, g: s, self, grads)

    def next_rng(self) -> tuple[TrainState, jax.Array]:
        """(state with a fresh key, a key to use for this step)."""
        new, use = jax.random.split(self.rng)
        return self.replace(rng=new), use
