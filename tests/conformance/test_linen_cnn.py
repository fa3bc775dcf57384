"""A linen CNN with BatchNorm and Dropout, trained the way flax's examples write it: a ``flax.training`` TrainState
subclass carrying ``batch_stats`` and a dropout key, BatchNorm in training mode, the statistics updated."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _harness import assert_close_trees, check_against_one_device
from flax.training import train_state


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(16, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
    batch_stats: dict
    key: jax.Array


def make_state():
    model = CNN()
    variables = model.init(jax.random.key(0), jnp.ones((1, 8, 8, 1)), train=False)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.sgd(0.05, momentum=0.9),  # as flax's imagenet example: a bias before BatchNorm has a zero
        # gradient, whose float noise Adam would amplify into parameter differences that mean nothing
        batch_stats=variables["batch_stats"],
        key=jax.random.key(1),
    )


def step(state, batch):
    dropout_key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            train=True,
            mutable=["batch_stats"],
            rngs={"dropout": dropout_key},
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    return state, {"loss": loss}


def batch():
    rng = np.random.default_rng(0)
    return {
        "image": rng.normal(size=(32, 8, 8, 1)).astype(np.float32),
        "label": rng.integers(0, 10, 32).astype(np.int32),
    }


@pytest.mark.slow  # 7 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["auto", "fsdp"])
def test_flax_examples_style_step_matches_one_device(plan):
    ref, ours, sharded = check_against_one_device(make_state, step, batch(), plan)
    assert sharded.layout.describe() == "parameters at state.params, optimizer state at state.opt_state"
    assert_close_trees(ref.params, ours.params)
    assert_close_trees(ref.batch_stats, ours.batch_stats)  # the running statistics moved, and alike
    initial = make_state().batch_stats
    assert not np.allclose(ours.batch_stats["BatchNorm_0"]["mean"], initial["BatchNorm_0"]["mean"])
    assert ours.key.sharding.spec == jax.P() and int(ours.step) == 5
