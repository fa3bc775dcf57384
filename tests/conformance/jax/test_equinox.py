"""Equinox's own examples, written as its documentation writes them, changed only at the decorator line
(``@eqx.filter_jit`` becomes ``@oh.spmd(mesh=...)``): each runs on 8 simulated devices and is compared with the
same code under ``eqx.filter_jit`` on one device, losses and parameters within 1e-4.

The module's arrays are traced and placed by the plan; everything else in it (``jax.nn.relu`` in the CNN's layer
list, the RNN's ``hidden_size: int``) is static, as ``eqx.filter_jit`` treats it."""

import math

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import optax
import pytest

import openhosti_jax as oh

eqx = pytest.importorskip("equinox")

STEPS = 3
TOLERANCE = 1e-4


def mesh():
    return oh.build_mesh(oh.MeshConfig(data=2, fsdp=4))


def assert_same_model(ours, ref):
    """The two modules' arrays agree within the tolerance, and everything else in them is the same object."""
    ours_arrays, ours_static = eqx.partition(ours, eqx.is_array)
    ref_arrays, ref_static = eqx.partition(ref, eqx.is_array)
    assert jax.tree.structure(ours_static) == jax.tree.structure(ref_static)
    assert all(a is b or a == b for a, b in zip(jax.tree.leaves(ours_static), jax.tree.leaves(ref_static), strict=True))
    for a, b in zip(jax.tree.leaves(ours_arrays), jax.tree.leaves(ref_arrays), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOLERANCE, atol=1e-6)


# 1. "Convolutional Neural Network on MNIST" (docs.kidger.site/equinox/examples/mnist): a list of layers holding
#    jax functions, make_step(model, opt_state, x, y) -> (model, opt_state, loss_value)


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        # Standard CNN setup: convolutional layer, followed by flattening,
        # with a small MLP on top.
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(1728, 512, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(512, 64, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(64, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    return cross_entropy(y, pred_y)


def cross_entropy(y, pred_y):
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


LEARNING_RATE = 3e-4
optim = optax.adamw(LEARNING_RATE)


def make_step(model, opt_state, x, y):
    loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss_value


def train_cnn(step, model, x, y):
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    losses = []
    for _ in range(STEPS):
        model, opt_state, train_loss = step(model, opt_state, x, y)
        losses.append(train_loss.item())
    return losses, model


def mnist_like(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


@pytest.mark.slow  # ~7 s on 2 loaded cores: a 0.9M-parameter CNN compiled twice
@pytest.mark.timeout(300)
def test_equinox_mnist_cnn_example_matches_filter_jit_on_one_device():
    x, y = mnist_like()
    with jax.default_device(jax.devices()[0]):  # equinox alone, on one device
        ref_losses, ref = train_cnn(eqx.filter_jit(make_step), CNN(jax.random.PRNGKey(5678)), x, y)
    step = oh.spmd(mesh=mesh(), plan="fsdp")(make_step)  # the one changed line: was @eqx.filter_jit
    losses, ours = train_cnn(step, CNN(jax.random.PRNGKey(5678)), x, y)
    np.testing.assert_allclose(losses, ref_losses, rtol=TOLERANCE)
    assert losses[-1] < losses[0], losses
    assert_same_model(ours, ref)
    assert ours.layers[2] is jax.nn.relu and isinstance(ours, CNN)
    assert step.layout.describe(oh.state.call.arg_path) == "parameters at args[0], optimizer state at args[1]"
    big = ours.layers[4].weight  # (512, 1728): split over fsdp by the plan
    assert big.sharding.spec != jax.P() and not big.sharding.is_fully_replicated


# 2. "Train RNN" (docs.kidger.site/equinox/examples/train_rnn): a Python int field read at trace time, a scan,
#    make_step(model, x, y, opt_state) -> (loss, model, opt_state) under the automatic plan


def get_data(dataset_size, *, key):
    t = jnp.linspace(0, 2 * math.pi, 16)
    offset = jrandom.uniform(key, (dataset_size, 1), minval=0, maxval=2 * math.pi)
    x1 = jnp.sin(t + offset) / (1 + t)
    x2 = jnp.cos(t + offset) / (1 + t)
    y = jnp.ones((dataset_size, 1))

    half_dataset_size = dataset_size // 2
    x1 = x1.at[:half_dataset_size].multiply(-1)
    y = y.at[:half_dataset_size].set(0)
    x = jnp.stack([x1, x2], axis=-1)

    return x, y


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.Module
    linear: eqx.nn.Linear
    bias: jnp.ndarray

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jrandom.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = lax.scan(f, hidden, input)
        # sigmoid because we're performing binary classification
        return jax.nn.sigmoid(self.linear(out) + self.bias)


def train_rnn(jit, learning_rate=3e-3, hidden_size=16, seed=5678, batch_size=32):
    data_key, model_key = jrandom.split(jrandom.PRNGKey(seed), 2)
    xs, ys = get_data(batch_size, key=data_key)
    model = RNN(in_size=2, out_size=1, hidden_size=hidden_size, key=model_key)

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        # Trains with respect to binary cross-entropy
        return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y))

    # Important for efficiency whenever you use JAX: wrap everything into a single JIT
    # region.
    @jit
    def make_step(model, x, y, opt_state):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    optim = optax.adam(learning_rate)
    # the example's optim.init(model) puts the int field into adam's state, which optax 0.2.5+ cannot cast back;
    # equinox's FAQ says to init on the floating arrays: the same optimizer state for every parameter
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(STEPS):
        loss, model, opt_state = make_step(model, xs, ys, opt_state)
        losses.append(loss.item())
    return losses, model, make_step


@pytest.mark.slow  # the automatic planner prices candidates and compiles the winner: ~15 s on 2 loaded cores
@pytest.mark.timeout(300)
def test_equinox_train_rnn_example_under_the_automatic_plan_matches_filter_jit():
    with jax.default_device(jax.devices()[0]):
        ref_losses, ref, _ = train_rnn(eqx.filter_jit)
    losses, ours, step = train_rnn(oh.spmd(mesh=mesh()))  # no plan named: the planner chooses
    np.testing.assert_allclose(losses, ref_losses, rtol=TOLERANCE)
    assert losses[-1] < losses[0], losses
    assert_same_model(ours, ref)
    assert ours.hidden_size == 16 and isinstance(ours, RNN)
    assert step.layout.describe(oh.state.call.arg_path) == "parameters at args[0], optimizer state at args[3]"
