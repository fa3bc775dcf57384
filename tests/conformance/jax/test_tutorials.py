"""Steps written as JAX's frameworks' own tutorials write them, changed only at the decorator line: each runs through
``@oh.spmd`` on 8 simulated devices and is compared with the same code under ``jax.jit`` / ``nnx.jit`` on one
device (losses or parameters within 1e-4 over a few steps)."""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import openhosti_jax as oh

STEPS = 4
MESH_CONFIG = oh.MeshConfig(data=2, fsdp=4)
SHARDED = jax.P(None, ("data", "fsdp"))


def mesh():
    return oh.build_mesh(MESH_CONFIG)


def close(a, b, rtol=1e-4, atol=1e-5):
    """Every leaf of ``a`` equals ``b``'s within the tolerances (PRNG keys by their data)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def images(n=32, size=8, classes=10, seed=0):
    """A synthetic MNIST-like batch whose label is learnable: the brightest of the first ``classes`` pixels."""
    image = np.random.default_rng(seed).normal(size=(n, size, size, 1)).astype(np.float32)
    return {"image": image, "label": np.argmax(image.reshape(n, -1)[:, :classes], axis=1).astype(np.int32)}


# 1. flax's NNX MNIST tutorial: train_step(model, optimizer, metrics, batch) mutates, returns nothing


class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(8 * 4 * 4, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def nnx_mnist(decorate):
    """The tutorial's objects and its train/eval steps under ``decorate`` (``nnx.jit`` or ``oh.spmd``)."""
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    traces = []

    @decorate
    def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
        traces.append(1)
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    @decorate
    def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
        loss, logits = loss_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])

    return model, optimizer, metrics, train_step, eval_step, traces


def run_mnist(decorate):
    model, optimizer, metrics, train_step, eval_step, traces = nnx_mnist(decorate)
    history = []
    for _ in range(STEPS):  # a one-batch dataset: the loss must fall
        assert train_step(model, optimizer, metrics, images()) is None
        history.append({k: float(v) for k, v in metrics.compute().items()})
        metrics.reset()
    model.eval()
    eval_step(model, metrics, images(seed=99))
    history.append({k: float(v) for k, v in metrics.compute().items()})
    return model, optimizer, history, train_step, traces


@pytest.mark.slow  # ~30 s on two shared CPU cores: four compiles (nnx.jit and @spmd, train and eval)
@pytest.mark.timeout(300)
def test_nnx_mnist_tutorial_step_mutates_model_optimizer_and_metrics_in_place():
    ref_model, _, ref_history, _, _ = run_mnist(nnx.jit)
    model, optimizer, history, train_step, traces = run_mnist(oh.spmd(mesh=mesh(), plan="fsdp"))
    for ours, ref in zip(history, ref_history, strict=True):
        assert ours.keys() == ref.keys()
        np.testing.assert_allclose([ours[k] for k in ref], [ref[k] for k in ref], rtol=1e-4, atol=1e-6)
    assert history[STEPS - 1]["loss"] < history[0]["loss"]  # it learned (the last entry is the eval step's)
    close(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param))
    assert len(traces) == 1  # four calls, one trace: later calls update the objects in place
    assert int(optimizer.step[...]) == STEPS
    assert model.linear1.kernel[...].sharding.spec == SHARDED
    assert optimizer.opt_state[0].mu["linear1"]["kernel"][...].sharding.spec == SHARDED
    assert train_step.report.events[0] == (
        "state layout: parameters at args[0], optimizer state at args[1]['opt_state']"
    )


# 2. optax's quick start: step(params, opt_state, batch, labels) -> (params, opt_state, loss)


def optax_quick_start(decorate):
    key = jax.random.key(0)
    params = {"hidden": jax.random.normal(key, (16, 512)) * 0.1, "out": jax.random.normal(key, (512, 1)) * 0.1}
    optimizer = optax.adam(learning_rate=1e-2)
    opt_state = optimizer.init(params)
    traces = []

    def loss(params, batch, labels):
        y_hat = jnp.tanh(batch @ params["hidden"]) @ params["out"]
        return optax.l2_loss(y_hat[:, 0], labels).mean()

    @decorate
    def step(params, opt_state, batch, labels):
        traces.append(1)
        loss_value, grads = jax.value_and_grad(loss)(params, batch, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss_value

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 64, 16)).astype(np.float32)
    y = np.sin(x.sum(-1))
    losses = []
    for i, (batch, labels) in enumerate(zip(x, y, strict=True)):
        params, opt_state, loss_value = step(params, opt_state, batch, labels)
        losses.append(float(loss_value))
        if i == 0:
            first = len(traces)
    return params, opt_state, losses, (first, len(traces)), step


@pytest.mark.parametrize("plan", ["zero3", pytest.param("auto", marks=pytest.mark.slow)])  # auto: ~20 s
@pytest.mark.timeout(300)
def test_optax_quick_start_loop_spreads_its_state_over_arguments(plan):
    ref_params, _, ref_losses, _, _ = optax_quick_start(jax.jit)
    params, opt_state, losses, (first, total), step = optax_quick_start(oh.spmd(mesh=mesh(), plan=plan))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert losses[-1] < losses[0]
    close(ref_params, params)
    assert first == total  # no trace after the first call
    if plan == "zero3":
        assert params["hidden"].sharding.spec == SHARDED and opt_state[0].mu["hidden"].sharding.spec == SHARDED
    else:  # planned from the step's own jaxpr, on the real batch, and compiled
        assert step.report.compiled_bytes is not None
    assert step.layout.describe(oh.state.call.arg_path) == "parameters at args[0], optimizer state at args[1]"


# 3. flax's linen tutorial: a TrainState with batch_stats, a dropout key argument, (state, metrics) returned


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(features=16, kernel_size=(3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=64)(x)
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(features=10)(x)


class TrainState(train_state.TrainState):
    batch_stats: dict


def linen_state():
    model = LinenCNN()
    variables = model.init(jax.random.key(0), jnp.ones((1, 8, 8, 1)), train=False)
    return TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-3), batch_stats=variables["batch_stats"]
    )


def linen_train_step(state, batch, dropout_key):
    dropout_train_key = jax.random.fold_in(key=dropout_key, data=state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            x=batch["image"],
            train=True,
            rngs={"dropout": dropout_train_key},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
        return loss, (logits, updates)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (logits, updates)), grads = grad_fn(state.params)
    state = state.apply_gradients(grads=grads)
    state = state.replace(batch_stats=updates["batch_stats"])
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}
    return state, metrics


def run_linen(step):
    state, losses = linen_state(), []
    for i in range(STEPS):
        state, metrics = step(state, images(seed=i), jax.random.key(7))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.slow  # ~30 s on two shared CPU cores: a conv net with BatchNorm compiled twice
@pytest.mark.timeout(300)
def test_linen_train_state_with_batch_stats_and_a_dropout_key_argument():
    ref, ref_losses = run_linen(jax.jit(linen_train_step))
    step = oh.spmd(linen_train_step, mesh=mesh(), plan="fsdp")
    ours, losses = run_linen(step)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    close(ref.params, ours.params)
    close(ref.batch_stats, ours.batch_stats)
    assert not np.allclose(ours.batch_stats["BatchNorm_0"]["mean"], 0.0)  # updated in training mode
    assert int(ours.step) == STEPS and ours.batch_stats["BatchNorm_0"]["mean"].sharding.spec == jax.P()
    assert step.layout.describe(oh.state.call.arg_path) == (
        "parameters at args[0].params, optimizer state at args[0].opt_state"
    )


# 4. an nnx step that returns its loss, with nnx.BatchNorm and nnx.Dropout


class Regressor(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 512, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(512, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(512, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.dropout(nnx.relu(self.bn(self.l1(x)))))


def run_regressor(decorate):
    model = Regressor(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @decorate
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            y_pred = model(x)
            return ((y_pred - y) ** 2).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 16)).astype(np.float32)
    y = np.sin(x[:, :1]).astype(np.float32)
    return model, [float(train_step(model, optimizer, x, y)) for _ in range(STEPS)]


def test_nnx_step_returning_its_loss_with_batchnorm_and_dropout():
    ref_model, ref_losses = run_regressor(nnx.jit)
    model, losses = run_regressor(oh.spmd(mesh=mesh()))  # the one-line change: no plan named, so planned
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert losses[-1] < losses[0]
    close(nnx.state(ref_model), nnx.state(model))  # parameters, batch statistics, dropout RNG counts
    assert model.bn.mean[...].sharding.spec == jax.P() and int(model.dropout.rngs.count[...]) == STEPS


# 5. a PRNG key and a Python step counter as extra arguments, a static flag


def run_noisy(decorate):
    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (32, 256)) * 0.1, "v": jax.random.normal(key, (256, 4)) * 0.1}
    tx = optax.sgd(0.1, momentum=0.9)
    opt_state = tx.init(params)
    traces = []

    @decorate
    def step(params, opt_state, batch, key, step_number, train):
        traces.append(train)
        key = jax.random.fold_in(key, step_number)

        def loss(p):
            h = jnp.tanh(batch["x"] @ p["w"])
            if train:
                h = h * jax.random.bernoulli(key, 0.8, h.shape) / 0.8
            return optax.softmax_cross_entropy_with_integer_labels(h @ p["v"], batch["y"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        if not train:
            return params, opt_state, value
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(64, 32)).astype(np.float32), "y": rng.integers(0, 4, 64).astype(np.int32)}
    losses = []
    for i in range(STEPS):
        params, opt_state, value = step(params, opt_state, batch, key, i, True)
        losses.append(float(value))
    params, opt_state, value = step(params, opt_state, batch, key, STEPS, train=False)
    return params, losses + [float(value)], traces


def test_extra_key_and_python_step_counter_arguments_and_a_static_flag():
    ref_params, ref_losses, _ = run_noisy(lambda f: jax.jit(f, static_argnames="train"))
    params, losses, traces = run_noisy(lambda f: oh.spmd(f, mesh=mesh(), plan="zero2", static_argnames="train"))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    close(ref_params, params)
    # one probe and one trace for train=True (the counter changes without a trace), the same for train=False
    assert traces == [True, True, False, False]
