"""The function types every entry point agrees on: a model's apply function, a train step, and the two loss
contracts, each with its own name so a parameter says which one it takes.

- `SummedLossFn`, taken as ``loss_sum_fn=``: ``(params, microbatch, rng) -> (loss_sum, count)``, for gradient
  accumulation (`openhosti_jax.make_train_step`, `openhosti_jax.accumulate_gradients`) and the load-balanced step
  (`openhosti_jax.balanced_step`), where sums over microbatches and devices are divided once.
- `MeanLossFn`, taken as ``mean_loss_fn=``: ``(outputs, targets) -> mean``, on a model's outputs, for the pipeline
  (`openhosti_jax.pipeline_step`), which runs the model itself.

(A torch loss given to `openhosti_jax.OptimizedDDP` is its ``criterion=``, torch's own word.)

Example:
    >>> import jax.numpy as jnp
    >>> from openhosti_jax.state.contracts import MeanLossFn, SummedLossFn
    >>> loss: SummedLossFn = lambda params, mb, rng: (jnp.sum((mb["x"] * params["w"]) ** 2), mb["x"].shape[0])
    >>> loss({"w": 2.0}, {"x": jnp.ones(3)}, None)[0].item()
    12.0
    >>> mse: MeanLossFn = lambda outputs, targets: jnp.mean((outputs - targets) ** 2)
    >>> mse(jnp.ones(3), jnp.zeros(3)).item()
    1.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

ApplyFn = Callable[..., Any]
"""``apply(params, *inputs, model_state=None, **kwargs) -> outputs``: the model's forward pass."""

StepFn = Callable[[Any, Any], tuple[Any, Any]]
"""``step(state, batch) -> (new_state, metrics)``: one optimizer step."""

SummedLossFn = Callable[[Any, Any, jax.Array | None], tuple[jax.Array, Any]]
"""``loss_sum_fn(params, microbatch, rng) -> (loss_sum, num_real)``: the loss summed over the real samples (or
tokens) and how many there are, so that sums over microbatches or devices divided once give the exact mean;
``(loss_sum, (num_real, aux))`` where the caller asks for ``has_aux``. Accumulation and balancing take this form."""

MeanLossFn = Callable[[Any, Any], jax.Array]
"""``mean_loss_fn(outputs, targets) -> mean``: the loss on the model's outputs (the last pipeline stage's), a mean
over the examples. The pipeline takes this form: it runs the model itself and averages over its microbatches."""
