"""The function types every entry point agrees on: a model's apply function, a train step, and a loss.

Example:
    >>> import jax.numpy as jnp
    >>> from openhosti_jax.state.contracts import LossFn
    >>> loss: LossFn = lambda params, mb, rng: (jnp.sum((mb["x"] * params["w"]) ** 2), mb["x"].shape[0])
    >>> loss({"w": 2.0}, {"x": jnp.ones(3)}, None)[0].item()
    12.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

ApplyFn = Callable[..., Any]
"""``apply(params, *inputs, model_state=None, **kwargs) -> outputs``: the model's forward pass."""

StepFn = Callable[[Any, Any], tuple[Any, Any]]
"""``step(state, batch) -> (new_state, metrics)``: one optimizer step."""

LossFn = Callable[[Any, Any, jax.Array | None], tuple[jax.Array, Any]]
"""``loss_fn(params, microbatch, rng) -> (loss_sum, num_real)``: the loss summed over the real samples (or tokens)
and how many there are, so that sums over microbatches or devices divided once give the exact mean;
``(loss_sum, (num_real, aux))`` where the caller asks for ``has_aux``. Accumulation, balancing and the pipeline
all take this form."""
