"""The plan behind ``openhosti plan --example gpt``: the bundled GPT with Adam, planned and AOT-verified.

Example:
    >>> from openhosti_jax.demo.examples import EXAMPLES
    >>> sorted(EXAMPLES)
    ['gpt', 'gpt-tiny']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from openhosti_jax.errors import PlanningError
from openhosti_jax.microbatch.train_step import make_train_step
from openhosti_jax.models.gpt import GPT, GPTConfig, next_token_loss
from openhosti_jax.models.llama import moe_loss
from openhosti_jax.models.moe import moe_metrics
from openhosti_jax.planner.choose import choose_plan
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import PlanReport

EXAMPLES: dict[str, tuple[GPTConfig, int]] = {
    "gpt": (GPTConfig(seq_len=64, d_model=128, n_heads=4, n_layers=4), 16),
    "gpt-tiny": (GPTConfig.tiny(), 16),
}
"""Example name -> (model config, global batch)."""


def gpt_step(state: Any, tokens: jax.Array) -> tuple[Any, Any]:
    """One next-token training step for the GPT example."""

    def loss(p: Any) -> jax.Array:
        total, count = next_token_loss(state.apply_fn(p, tokens, model_state=state.model_state), tokens)
        return total / count

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def token_train_step(state: Any, tokens: jax.Array) -> tuple[Any, Any]:
    """The library's own training step on a batch of token sequences, as `openhosti_jax.make_train_step` builds it
    (accumulating over the microbatches the plan runs): the mean next-token loss of the model's logits. What
    ``openhosti predict --compile`` compiles for a language-model preset."""

    def loss_sum(params: Any, batch: jax.Array, rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        del rng
        return next_token_loss(state.apply_fn(params, batch, model_state=state.model_state), batch)

    return make_train_step(loss_sum)(state, tokens)


def moe_step(state: Any, tokens: jax.Array) -> tuple[Any, Any]:
    """One next-token training step for a model whose ``with_aux=True`` call returns ``(logits, aux)`` (the MoE
    `openhosti_jax.models.llama.Llama`): the loss adds the MoE layers' auxiliary losses; the metrics add
    `openhosti_jax.models.moe.moe_metrics` (tokens per expert and dropped fraction per layer)."""

    def loss(p: Any) -> tuple[jax.Array, Any]:
        logits, aux = state.apply_fn(p, tokens, with_aux=True, model_state=state.model_state)
        total, count = next_token_loss(logits, tokens)
        return total / count + moe_loss(aux), (total / count, aux)

    (value, (lm, aux)), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value, "lm_loss": lm, **moe_metrics(aux)}


def example_inputs(name: str) -> tuple[Any, optax.GradientTransformation, jax.ShapeDtypeStruct]:
    """(init_fn, optimizer, abstract token batch) of an example."""
    if name not in EXAMPLES:
        raise PlanningError(f"unknown example {name!r}; expected one of {sorted(EXAMPLES)}")
    cfg, batch = EXAMPLES[name]
    return (
        (lambda r: GPT(cfg, rngs=nnx.Rngs(r))),
        optax.adam(1e-3),
        jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32),
    )


def plan_example(
    name: str = "gpt", devices: Sequence[jax.Device] | None = None, memory_budget: int | None = None
) -> tuple[ShardingPlan, PlanReport, str]:
    """(plan, report, a one-line header naming the example) for an example model on ``devices`` (default: all)."""
    init_fn, tx, batch = example_inputs(name)
    the_plan, report = choose_plan(init_fn, tx, batch, devices, memory_budget, step_fn=gpt_step)
    cfg, n = EXAMPLES[name]
    header = f"example {name}: GPT {cfg.num_params():,} parameters, batch {n} x {cfg.seq_len} tokens, Adam"
    return the_plan, report, header
