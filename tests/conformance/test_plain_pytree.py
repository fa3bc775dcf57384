"""A plain ``(params, opt_state)`` step written with optax only, trained through ``@spmd`` unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _harness import assert_close_trees, check_against_one_device

TX = optax.adam(1e-2)


def make_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (32, 128)) * 0.1, "w2": jax.random.normal(k2, (128, 4)) * 0.1}
    return params, TX.init(params)


def loss(params, batch):
    logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def step(state, batch):
    params, opt_state = state
    loss_value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss_value}


def batch():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(32, 32)).astype(np.float32), "y": rng.integers(0, 4, 32).astype(np.int32)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["auto", "fsdp", "dp", "zero1", "zero2"])
def test_plain_pytree_step_matches_one_device(plan):
    ref, ours, sharded = check_against_one_device(make_state, step, batch(), plan)
    assert_close_trees(ref, ours)
    assert sharded.layout.describe() == "parameters at state[0], optimizer state at state[1]"
    stage = sharded.plan.zero_stage
    sharded_spec, replicated = jax.P(None, ("data", "fsdp")), jax.P(None, None)
    if plan != "auto":  # ZeRO-1: Adam's moments sharded; 3: the parameters too; the step counter always replicated
        assert ours[0]["w1"].sharding.spec == (sharded_spec if stage == 3 else replicated)
        assert ours[1][0].mu["w1"].sharding.spec == (sharded_spec if stage >= 1 else replicated)
        assert ours[1][0].count.sharding.spec == jax.P()
