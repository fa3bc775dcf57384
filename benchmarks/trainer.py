"""`Trainer.fit` overhead: the same jitted ``@spmd`` GPT step driven by `Trainer.fit` (JSONL metrics, logging every
10 steps) and by a bare Python loop, timed side by side.

Both take their batches from the same kind of `ArrayDataset`, run ``STEPS`` steps per round and wait for the last
step at the end of the round; the rounds alternate and the medians of the per-step times are compared. The Trainer
keeps metrics on the device until its logging interval; the bare loop never reads them. Prints one JSON object
(keys and goals in benchmarks/README.md); ``trainer_over_raw_loop_step`` is the headline. ``--quick``: 4 rounds
of 10 steps of a smaller GPT (d_model 64, seq 32, batch 16) over a smaller corpus, the same code paths.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import goals  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from openhosti_jax import MeshConfig, Trainer, build_mesh  # noqa: E402
from openhosti_jax.data import ArrayDataset  # noqa: E402
from openhosti_jax.demo.gpt_job import GPTJob, build_job  # noqa: E402
from openhosti_jax.models.gpt import GPTConfig, make_corpus  # noqa: E402
from openhosti_jax.state.layout import step_of  # noqa: E402

ROUNDS, STEPS, LOG_EVERY = (4, 10, 10) if goals.QUICK else (12, 20, 10)
# quick: a narrower, shorter GPT and batch (the same code paths)
D_MODEL, SEQ, BATCH = (64, 32, 16) if goals.QUICK else (128, 64, 32)


def main() -> None:
    job = GPTJob(
        model=GPTConfig(seq_len=SEQ, d_model=D_MODEL, n_heads=4, n_layers=2),
        global_batch=BATCH,
        num_sequences=1024 if goals.QUICK else 4096,
        progress=False,
        print_plan=False,
    )
    mesh = build_mesh(MeshConfig(data=2, fsdp=4))
    state, _, step, data = build_job(job, mesh)
    # the bare loop's state: a copy of the same initial state (one init compile fewer than a second build_job);
    # its data: the same kind of ArrayDataset over the same corpus, as build_job makes it
    raw_state = jax.tree.map(jnp.copy, state)
    corpus = make_corpus(job.num_sequences, job.model.seq_len, seed=job.seed)
    raw_data = ArrayDataset({"tokens": corpus}, job.global_batch, seed=job.seed)
    for _ in range(3):  # compile and warm up both (the same jitted step)
        state, m = step(state, next(data))
        raw_state, m = step(raw_state, next(raw_data))
    jax.block_until_ready((state, raw_state))
    metrics_path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    trainer = Trainer(step, metrics_path=metrics_path, progress=False, log_every=LOG_EVERY)
    times: dict[str, list[float]] = {"trainer": [], "raw": []}
    for _ in range(ROUNDS):
        t = time.perf_counter()
        state = trainer.fit(state, data, num_steps=step_of(state) + STEPS).state
        jax.block_until_ready(state)
        times["trainer"].append((time.perf_counter() - t) / STEPS)
        t = time.perf_counter()
        for _ in range(STEPS):
            raw_state, metrics = step(raw_state, next(raw_data))
        jax.block_until_ready((raw_state, metrics))
        times["raw"].append((time.perf_counter() - t) / STEPS)
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (max(v) - min(v)) / med[k] for k, v in times.items()}
    out = {
        "trainer_over_raw_loop_step": med["trainer"] / med["raw"],
        "trainer_step_ms": med["trainer"] * 1e3,
        "raw_step_ms": med["raw"] * 1e3,
        "round_spread_over_median": spread,
        "log_every": LOG_EVERY,
        "rounds_x_steps": [ROUNDS, STEPS],
        "model": f"GPT d_model={D_MODEL} 2 layers seq {SEQ}, batch {BATCH}, data=2 fsdp=4, 8 CPU devices",
    }
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
