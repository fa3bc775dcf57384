"""The CPU-checkable parts of running fast on accelerators: fp8 training against bf16, packed sequences against their
documents run alone, and the persistent compile cache across processes.

- ``fp8_loss_over_bf16_loss``: a GPT trained 200 steps (the same initialisation and batches) with precision ``"fp8"``
  (its blocks' matmuls in fp8 at the current per-tensor scale; XLA on CPU emulates the fp8 rounding) and ``"bf16"``;
  the mean loss of the last 20 steps, fp8's over bf16's.
- ``packed_loss_over_separate``: a GPT's next-token loss per target over rows packed with documents by segment ids,
  over the same documents' loss run one by one (the same weights), float32.
- ``compile_cache_second_process_compiles``: a second process running the same ``@spmd`` step as a first (the same
  cache directory): the times jax compiled the step rather than loading it from the persistent cache (the first
  process: 1).

    python benchmarks/fast_paths.py            # 200 steps of a 2-layer GPT 128 wide, seq 128, 16 sequences a step
    python benchmarks/fast_paths.py --quick    # 200 steps of the same at seq 64, 8 sequences a step

Last stdout line: one JSON object (`goals.emit`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import goals

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = """
import json, logging, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, optax
from flax import nnx
import openhosti_jax as oh
from openhosti_jax.demo.gpt_job import gpt_train_step
from openhosti_jax.models.gpt import GPT, GPTConfig, make_corpus

class Count(logging.Handler):  # jax's compiler logs each persistent-cache hit and miss with the program's name
    hits = misses = 0
    def emit(self, record):
        text = record.getMessage()
        if "'jit_traced" in text:
            Count.hits += text.startswith("Persistent compilation cache hit")
            Count.misses += text.startswith("PERSISTENT COMPILATION CACHE MISS")

log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.addHandler(Count())
mesh = oh.build_mesh(oh.MeshConfig(data=2, fsdp=4))
state, plan = oh.create_train_state(lambda r: GPT(GPTConfig.tiny(), rngs=nnx.Rngs(r)), optax.adamw(1e-3), mesh,
                                    plan="fsdp")
step = oh.spmd(gpt_train_step, mesh=mesh, plan=plan)
state, metrics = step(state, {"tokens": jnp.asarray(make_corpus(8, 32))})
print(json.dumps({"compiles": Count.misses, "hits": Count.hits, "loss": float(metrics["loss"])}))
"""


def compile_cache_runs(cache: str) -> list[dict]:
    """Two processes of the same step, one cache directory: each one's compiles and cache hits of the step."""
    env = {**os.environ, "OPENHOSTI_CACHE_DIR": cache, "OPENHOSTI_COMPILE_CACHE": "1"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240)
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def train_losses(cfg, precision: str, steps: int, batch: int) -> list[float]:  # noqa: ANN001 - GPTConfig
    """Per-step losses of the GPT trained ``steps`` steps under ``precision`` on one device, from seed 0."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import openhosti_jax as oh
    from openhosti_jax.demo.gpt_job import gpt_train_step
    from openhosti_jax.models.gpt import GPT, make_corpus

    mesh = oh.build_mesh(oh.MeshConfig(data=1), jax.devices()[:1])
    state, plan = oh.create_train_state(lambda r: GPT(cfg, rngs=nnx.Rngs(r)), optax.adamw(3e-3), mesh, plan="dp")
    step = oh.spmd(gpt_train_step, mesh=mesh, plan=dataclasses.replace(plan, precision=precision))
    data = make_corpus(steps * batch, cfg.seq_len, seed=1)
    losses = []
    for i in range(steps):
        state, m = step(state, {"tokens": jnp.asarray(data[i * batch : (i + 1) * batch])})
        losses.append(m["loss"])
    return [float(x) for x in jax.device_get(losses)]


def packed_over_separate(cfg) -> float:  # noqa: ANN001 - GPTConfig
    """Loss per target of rows packed with documents, over the documents' own run one by one."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from openhosti_jax.models.gpt import GPT, make_corpus, next_token_loss

    model = GPT(cfg, rngs=nnx.Rngs(0))
    s = cfg.seq_len
    lengths = [[s // 4, s // 2, s // 4], [s // 2, s // 4]]  # the second row ends in padding
    ids = np.zeros((2, s), np.int32)
    for r, row in enumerate(lengths):
        ids[r, : sum(row)] = np.repeat(np.arange(1, len(row) + 1), row)
    tokens = make_corpus(2, s, seed=2)
    graphdef, weights = nnx.split(model)
    packed = jax.jit(lambda w, t, seg: next_token_loss(nnx.merge(graphdef, w)(t, segment_ids=seg), t, None, seg))
    alone = jax.jit(lambda w, t: next_token_loss(nnx.merge(graphdef, w)(t), t))
    total, count = packed(weights, jnp.asarray(tokens), jnp.asarray(ids))
    docs: dict[int, list] = {}
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            docs.setdefault(n, []).append(tokens[r, start : start + n])
            start += n
    sums = [alone(weights, jnp.asarray(np.stack(group))) for group in docs.values()]
    separate = sum(float(t) for t, _ in sums) / sum(float(c) for _, c in sums)
    return (float(total) / float(count)) / separate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 2-layer GPT at seq 64")
    p.add_argument("--steps", type=int, default=200, help="training steps per precision")
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["OPENHOSTI_COMPILE_CACHE"] = "0"  # this process times nothing from a cache; its children use one
    sys.path.insert(0, ROOT)
    from openhosti_jax.models.gpt import GPTConfig

    cfg = GPTConfig(d_model=128, n_heads=4, n_layers=2, seq_len=64 if args.quick else 128)
    batch = 8 if args.quick else 16
    t0 = time.perf_counter()
    bf16 = train_losses(dataclasses.replace(cfg, dtype="bfloat16"), "bf16", args.steps, batch)
    fp8 = train_losses(dataclasses.replace(cfg, dtype="bfloat16"), "fp8", args.steps, batch)
    train_s = time.perf_counter() - t0
    tail = 20
    with tempfile.TemporaryDirectory() as cache:
        first, second = compile_cache_runs(cache)
    result = {
        "fp8_loss_over_bf16_loss": (sum(fp8[-tail:]) / tail) / (sum(bf16[-tail:]) / tail),
        "fp8_final_loss": sum(fp8[-tail:]) / tail,
        "bf16_final_loss": sum(bf16[-tail:]) / tail,
        "initial_loss": bf16[0],
        "train_steps": args.steps,
        "train_seconds": train_s,
        "packed_loss_over_separate": packed_over_separate(cfg),
        "compile_cache_second_process_compiles": second["compiles"],
        "compile_cache_second_process_hits": second["hits"],
        "compile_cache_first_process_compiles": first["compiles"],
        "compile_cache_same_loss": second["loss"] == first["loss"],
    }
    goals.emit(result, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
