"""``@spmd`` overhead: the same user's step, ``@spmd`` on a 1-device mesh vs plain ``jax.jit`` (state donated in
both), timed side by side.

The step is the conformance suite's flax-examples-style one: a linen CNN with BatchNorm and Dropout, its state a
``flax.training`` TrainState subclass carrying ``batch_stats`` and a dropout key. Both runs take the batch already on
the device, alternate in ``ROUNDS`` rounds of ``STEPS`` steps, and the medians of their per-step times are compared.
Prints one JSON object (keys and goals in benchmarks/README.md); ``spmd_over_jit_1device_same_math`` is the
headline. ``--quick``: batch 16, 6 rounds of 3 steps, the same model and code paths.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import statistics  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import goals  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import openhosti_jax as oh  # noqa: E402

ROUNDS, STEPS, BATCH = (6, 3, 16) if goals.QUICK else (30, 5, 64)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(32, (3, 3))(x)))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(64, (3, 3))(x)))
        x = nn.Dropout(0.2, deterministic=not train)(x.reshape((x.shape[0], -1)))
        return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
    batch_stats: dict
    key: jax.Array


def make_state(device):
    model = CNN()
    variables = model.init(jax.random.key(0), jnp.ones((1, 32, 32, 3)), train=False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.sgd(0.05, momentum=0.9),
        batch_stats=variables["batch_stats"],
        key=jax.random.key(1),
    )
    return jax.device_put(state, device)


def step(state, batch):
    key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            train=True,
            mutable=["batch_stats"],
            rngs={"dropout": key},
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"]), {"loss": loss}


def main() -> None:
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    host = {
        "image": rng.normal(size=(BATCH, 32, 32, 3)).astype(np.float32),
        "label": rng.integers(0, 10, BATCH).astype(np.int32),
    }
    batch = jax.device_put(host, device)
    mesh = oh.build_mesh(oh.MeshConfig(data=1), devices=[device])
    runs = {
        "jit": [jax.jit(step, donate_argnums=0), make_state(device), []],
        "spmd": [oh.spmd(step, mesh=mesh, plan="dp"), make_state(device), []],
    }
    for run in runs.values():  # compile, and the same number of warm-up steps for both
        for _ in range(3):
            run[1], metrics = run[0](run[1], batch)
        jax.block_until_ready(metrics)
    for _ in range(ROUNDS):
        for run in runs.values():
            fn, state, times = run
            for _ in range(STEPS):
                t = time.perf_counter()
                state, metrics = fn(state, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t)
            run[1] = state
    med = {name: statistics.median(run[2]) for name, run in runs.items()}
    out = {
        "spmd_over_jit_1device_same_math": med["spmd"] / med["jit"],
        "spmd_step_ms": med["spmd"] * 1e3,
        "jit_step_ms": med["jit"] * 1e3,
        "spmd_overhead_us": (med["spmd"] - med["jit"]) * 1e6,
        "model": "linen CNN (2 conv + BatchNorm, Dropout, Dense), flax TrainState subclass, SGD momentum",
        "batch": BATCH,
        "rounds_x_steps": [ROUNDS, STEPS],
    }
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
