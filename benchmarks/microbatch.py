"""Adaptive microbatch benchmark: the finder's choice vs exhaustive search, and its throughput.

A 4-layer MLP + Adam step, batch sharded over 8 simulated CPU devices. Every divisor of the per-device batch is
compiled (exhaustive reference); the synthetic budget is placed between the smallest and largest measured peaks
(geometric midpoint), so some sizes fit and some do not. The binary search then runs with fresh compiles and is
timed; finally the chosen size, microbatch 1 and the largest fitting size train side by side, alternated.

Prints one JSON object on its last line (keys and goals in benchmarks/README.md). Run:
``python benchmarks/microbatch.py`` (``--quick``: per-device batch 64, width 16, 5 timing rounds; the same code paths).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import goals  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from openhosti_jax.mesh import MeshConfig, build_mesh  # noqa: E402
from openhosti_jax.microbatch import (  # noqa: E402
    compile_bound,
    compiled_peak_bytes,
    find_microbatch,
    make_train_step,
)
from openhosti_jax.sizes import divisors  # noqa: E402
from openhosti_jax.state import TrainState  # noqa: E402

# quick: a narrower MLP so that, as at full size, activations outgrow the fixed bytes and some sizes do not fit
PER_DEVICE, WIDTH = (64, 16) if goals.QUICK else (256, 64)
LAYERS, MARGIN = 4, 0.1
ROUNDS, STEPS = (5 if goals.QUICK else 41), 1


def loss_sum_fn(params, mb, rng):
    h = mb["x"]
    for i in range(LAYERS):
        h = jnp.tanh(h @ params[f"w{i}"])
    mask = mb["mask"].astype(jnp.float32)
    return jnp.sum(((h @ params["out"])[:, 0] - mb["y"]) ** 2 * mask), jnp.sum(mask)


def main() -> None:
    mesh = build_mesh(MeshConfig(data=8))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    keys = jax.random.split(jax.random.key(0), LAYERS + 3)
    params = {f"w{i}": jax.random.normal(keys[i], (WIDTH, WIDTH)) / 8 for i in range(LAYERS)}
    params["out"] = jax.random.normal(keys[LAYERS], (WIDTH, 1)) / 8
    tx = optax.adam(1e-3)

    def fresh_state() -> TrainState:
        state = TrainState.create(apply_fn=None, params=params, tx=tx, rng=jax.random.key(1))
        return jax.tree.map(jnp.copy, jax.device_put(state, rep))

    n = 8 * PER_DEVICE
    batch = jax.device_put(
        {
            "x": jax.random.normal(keys[-2], (n, WIDTH)),
            "y": jax.random.normal(keys[-1], (n,)),
            "mask": jnp.ones((n,), bool),
        },
        rows,
    )
    abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), fresh_state())

    def compile_for(size: int) -> jax.stages.Compiled:
        step = make_train_step(loss_sum_fn, PER_DEVICE // size, microbatch_sharding=rows)
        return jax.jit(step, donate_argnums=0).lower(abstract_state, batch).compile()

    t0 = time.perf_counter()
    exhaustive = {s: compile_for(s) for s in divisors(PER_DEVICE)}
    exhaustive_seconds = time.perf_counter() - t0
    peaks = {s: compiled_peak_bytes(c) for s, c in exhaustive.items()}
    budget = int(math.sqrt(min(peaks.values()) * max(peaks.values())) / (1 - MARGIN))
    limit = int(budget * (1 - MARGIN))
    largest_fitting = max(s for s, p in peaks.items() if p <= limit)

    choice = find_microbatch(compile_for, PER_DEVICE, budget, margin=MARGIN)

    runners = {"chosen": choice.compiled, "mb1": exhaustive[1], "largest_fitting": exhaustive[largest_fitting]}
    states = {name: fresh_state() for name in runners}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for name, fn in runners.items():  # warm-up
        states[name], m = fn(states[name], batch)
        jax.block_until_ready(m)
    for _ in range(ROUNDS):
        for name, fn in runners.items():
            t = time.perf_counter()
            for _ in range(STEPS):
                states[name], m = fn(states[name], batch)
            jax.block_until_ready((states[name], m))
            times[name].append(time.perf_counter() - t)
    sps = {name: n * STEPS / statistics.median(ts) for name, ts in times.items()}

    print(f"# {choice}")
    out = {
        "chosen_over_largest_fitting": choice.size / largest_fitting,
        "compiles": choice.compiles,
        "compile_bound": compile_bound(PER_DEVICE),
        "search_seconds": round(choice.seconds, 3),
        "exhaustive_seconds": round(exhaustive_seconds, 3),
        "chosen_size": choice.size,
        "largest_fitting_size": largest_fitting,
        "per_device_batch": PER_DEVICE,
        "budget_bytes": budget,
        "limit_bytes": limit,
        "peak_bytes_by_size": {str(s): p for s, p in sorted(peaks.items())},
        "samples_per_s_chosen": round(sps["chosen"], 1),
        "samples_per_s_mb1": round(sps["mb1"], 1),
        "samples_per_s_largest_fitting": round(sps["largest_fitting"], 1),
        "chosen_over_mb1_samples_per_s": round(sps["chosen"] / sps["mb1"], 3),
        "chosen_over_largest_fitting_samples_per_s": round(sps["chosen"] / sps["largest_fitting"], 3),
    }
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
