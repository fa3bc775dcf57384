"""An nnx model with BatchNorm, ``Dropout(rngs=...)`` and `nnx.Optimizer`, trained through ``@spmd`` as the state of
``nnx.split((model, optimizer))``: parameters found as what the optimizer mirrors, batch statistics updated."""

import jax
import numpy as np
import optax
import pytest
from _harness import assert_close_trees, check_against_one_device
from flax import nnx


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 512, rngs=rngs)
        self.bn = nnx.BatchNorm(512, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(512, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def build():
    model = Net(nnx.Rngs(0, dropout=1))
    return nnx.split((model, nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)))


GRAPHDEF, _ = build()


def make_state():
    return build()[1]


def step(state, batch):
    model, optimizer = nnx.merge(GRAPHDEF, state)

    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(batch["x"]), batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss}


def batch():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.integers(0, 4, 32).astype(np.int32)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["auto", "fsdp"])
def test_nnx_split_state_matches_one_device(plan):
    ref, ours, sharded = check_against_one_device(make_state, step, batch(), plan)
    assert sharded.layout.param_rels is not None  # the batch statistics share the model's node, not the optimizer's
    assert_close_trees(ref, ours)
    stats = ours[0]["bn"]["mean"][...]
    assert not np.allclose(np.asarray(stats), 0.0)  # updated in training mode
    if plan == "fsdp":
        assert ours[0]["l1"]["kernel"][...].sharding.spec == jax.P(None, ("data", "fsdp"))
        assert stats.sharding.spec == jax.P()  # not a parameter: replicated
