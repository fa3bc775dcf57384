"""Mixture of experts on 8 CPU devices: an expert-parallel step against a dense one of the same active FLOPs, the
all-to-all against the planner's price, and the per-device state against its closed form.

- ``moe_step_over_dense_equal_active_flops``: median step time (create_train_state ZeRO-3, ``@spmd``, Adam) of a
  Llama whose MLPs are MoE blocks (``E`` experts of width ``F``, top-2, dropless, on ``expert=4 x data=2``) over the
  same Llama with dense MLPs of width ``2F`` (on ``fsdp=4 x data=2``): both do the same matmul FLOPs per token but
  the router's (``moe_over_dense_flops_per_token``). The gap is the price of routing on this backend: XLA's CPU
  ``jax.lax.ragged_dot`` runs every group over all the rows it is given (measured on one core: 2 groups over 4096
  rows 3.6x one dense matmul of the same FLOPs, and still 2.5x with a quarter of the rows in the groups), and the
  dropless exchange is padded to the worst case, so each device hands it ``expert x`` its assignments' rows, three
  quarters of them padding at ``expert=4``; the tokens are sorted, gathered and scattered on the way in and out
  (memory-bound work a dense MLP has none of); and each layer adds two all-to-alls forward and two backward, which
  on CPU cost several times an all-gather of the same bytes. A grouped matmul that skips empty rows (megablox on
  TPU, a GPU grouped GEMM) and an exchange sized to the real counts take most of this back.
- ``all_to_all_pred_over_measured``: one `jax.lax.all_to_all` over the 8 devices of a 1 MiB per-device buffer (the
  dropless dispatch's send buffer at the benchmark's full shapes: ``expert`` x 256 assignments x 256 x fp32),
  measured as a chain of dependent exchanges in one program minus the calibrated launch time, each after a kernel
  that streams 32 MiB per device (as the calibration times its collectives, amid other kernels: `FLUSH_BYTES`),
  over `openhosti_jax.planner.profiles.all_to_all_seconds` on a profile calibrated just before (its measured
  all-to-all curve, interpolated); the median of ``A2A_PAIRS`` (calibration, measurement) pairs, each in
  ``all_to_all_pred_over_measured_pairs`` (the cores are shared: the load drifts 2x in minutes).
  ``all_to_all_pred_over_measured_by_size`` gives 64 KiB, 1 MiB and 4 MiB. Priced as an all-gather of the same
  bus bytes instead, as a spec-sheet profile prices it, the ratio reads 0.15-0.36
  (``all_gather_price_over_measured``): XLA's CPU all-to-all is that much slower than its all-gather.
- ``expert_parallel_state_bytes_over_formula``: device 0's bytes of parameters and Adam state (12 bytes per
  parameter) of an expert-parallel Llama on ``expert=4 x data=2``, at ZeRO 0, 1 and 3, over the closed form: the
  experts split over ``expert`` and, ZeRO's stage permitting, over ``data``; the other parameters over ``data x
  expert`` (ZeRO treats ``expert`` as a data axis outside the experts): ZeRO-0 ``12 (P_dense + P_exp / 4)``, ZeRO-1
  ``4 (P_dense + P_exp / 4) + 8 P / 8``, ZeRO-3 ``12 P / 8`` (leaves under 4096 elements, the norms, stay
  replicated: the small excess).

Prints one JSON object (keys and goals in benchmarks/README.md). ``--quick``: smaller shapes, fewer rounds, the same
code paths.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import statistics  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import goals  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import openhosti_jax as oh  # noqa: E402
from openhosti_jax.demo.examples import gpt_step, moe_step  # noqa: E402
from openhosti_jax.models.llama import Llama, LlamaConfig  # noqa: E402
from openhosti_jax.planner.calibrate import (  # noqa: E402
    alternated_medians,
    calibrate,
    calibration_sizes,
    chain_length,
)
from openhosti_jax.planner.profiles import all_to_all_seconds  # noqa: E402

D, F, E, LAYERS, SEQ, BATCH = (64, 128, 8, 2, 32, 16) if goals.QUICK else (256, 512, 8, 4, 64, 16)
ROUNDS, STEPS = (4, 2) if goals.QUICK else (6, 2)
A2A_SIZES = (2**16, 2**20, 2**22)
A2A_MAIN = 2**20
A2A_REPS = 5 if goals.QUICK else 15
A2A_PAIRS = 2 if goals.QUICK else 3
FLUSH_BYTES = 2**25
"""Per-device bytes an elementwise kernel streams before each timed all-to-all (the calibration's largest working
set): a step's exchange follows other work that has evicted its buffer from the caches, as the calibration's
alternated kernels do; timed back to back instead, a 1 MiB exchange found them warm and ran 1.5x faster (3.3 ms
against 5.1 ms on this machine)."""


def config(moe: bool) -> LlamaConfig:
    base = {"vocab_size": 512, "seq_len": SEQ, "d_model": D, "n_heads": 4, "n_kv_heads": 4, "n_layers": LAYERS}
    if moe:
        return LlamaConfig(**base, ffn=F, num_experts=E, top_k=2, scan_layers=True)
    return LlamaConfig(**base, ffn=2 * F, scan_layers=True)  # top_k experts of width F: the same active FLOPs


def step_times() -> dict:
    tokens = np.random.default_rng(0).integers(0, 512, (BATCH, SEQ)).astype(np.int32)
    runs = {}
    for name, moe, sizes in (("moe", True, {"data": 2, "expert": 4}), ("dense", False, {"data": 2, "fsdp": 4})):
        mesh = oh.build_mesh(oh.MeshConfig.from_sizes(sizes))
        cfg = config(moe)
        state, plan = oh.create_train_state(lambda r, c=cfg: Llama(c, rngs=nnx.Rngs(r)), optax.adam(1e-3), mesh, plan=3)
        step = oh.spmd(moe_step if moe else gpt_step, mesh=mesh, plan=plan)
        batch = jax.device_put(tokens, NamedSharding(mesh, plan.batch_spec))
        for _ in range(2):  # compile and warm up
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        runs[name] = [step, state, batch, [], cfg]
    for _ in range(ROUNDS):
        for run in runs.values():
            step, state, batch, times, _ = run
            for _ in range(STEPS):
                t = time.perf_counter()
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t)
            run[1] = state
    med = {k: statistics.median(r[3]) for k, r in runs.items()}
    flops = {k: r[4].flops_per_token() for k, r in runs.items()}
    return {
        "moe_step_over_dense_equal_active_flops": med["moe"] / med["dense"],
        "moe_step_ms": med["moe"] * 1e3,
        "dense_step_ms": med["dense"] * 1e3,
        "moe_over_dense_flops_per_token": flops["moe"] / flops["dense"],
    }


def all_to_all() -> dict:
    """Calibrate, then time the all-to-alls at once, ``A2A_PAIRS`` times: the machine's load drifts (its cores are
    shared), and a price measured minutes before the exchange it prices reads that drift as error."""
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object), ("d",))

    def chain(length: int):
        def f(a):
            for _ in range(length):  # dependent exchanges: each one's input is the last one's output
                a = jax.lax.all_to_all(a, "d", 0, 0, tiled=True)
            return a

        return f

    big = jax.device_put(jnp.ones((n * FLUSH_BYTES // 4,), jnp.float32), NamedSharding(mesh, P("d")))
    flush = jax.jit(jax.shard_map(lambda a: a * 1.0001 + 1.0, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    fns = []
    for size in A2A_SIZES:
        x = jax.device_put(jnp.ones((n * size // 4,), jnp.float32), NamedSharding(mesh, P("d")))
        g = jax.jit(jax.shard_map(chain(chain_length(size)), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        fns += [lambda: flush(big), lambda g=g, x=x: g(x)]  # each exchange after other work, as in a step
    ratios, gathered, measured_us = [], [], []
    for _ in range(A2A_PAIRS):
        profile = calibrate(devices, sizes=calibration_sizes(max(A2A_SIZES)))
        raw = alternated_medians(fns, A2A_REPS)[1::2]
        measured = [
            max(t - profile.launch_seconds, 1e-7) / chain_length(s) for t, s in zip(raw, A2A_SIZES, strict=True)
        ]
        ratios.append([all_to_all_seconds(profile, s, n) / m for s, m in zip(A2A_SIZES, measured, strict=True)])
        gathered.append(profile.link_seconds("all_gather", A2A_MAIN, n) / measured[A2A_SIZES.index(A2A_MAIN)])
        measured_us.append([m * 1e6 for m in measured])
    med = np.median(np.asarray(ratios), axis=0).tolist()
    return {
        "all_to_all_pred_over_measured": med[A2A_SIZES.index(A2A_MAIN)],
        "all_to_all_pred_over_measured_by_size": dict(zip(map(str, A2A_SIZES), med, strict=True)),
        "all_to_all_pred_over_measured_pairs": [r[A2A_SIZES.index(A2A_MAIN)] for r in ratios],
        "all_gather_price_over_measured": float(np.median(gathered)),
        "all_to_all_measured_us_by_size": dict(
            zip(map(str, A2A_SIZES), np.median(np.asarray(measured_us), axis=0).tolist(), strict=True)
        ),
    }


def state_bytes() -> dict:
    cfg = config(True)
    mesh = oh.build_mesh(oh.MeshConfig.from_sizes({"data": 2, "expert": 4}))
    params = nnx.state(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    total = sum(x.size for x in jax.tree.leaves(params))
    experts = sum(
        x.size for p, x in jax.tree_util.tree_leaves_with_path(params) if "'w_" in jax.tree_util.keystr(p)
    )  # the stacked experts' w_gate, w_up, w_down
    dense = total - experts
    formula = {
        0: 12 * (dense + experts / 4),
        1: 4 * (dense + experts / 4) + 8 * total / 8,
        3: 12 * total / 8,
    }
    dev = jax.devices()[0]
    ratios = []
    for stage, want in formula.items():
        state, _ = oh.create_train_state(lambda r: Llama(cfg, rngs=nnx.Rngs(r)), optax.adam(1e-3), mesh, plan=stage)
        got = sum(
            s.data.nbytes
            for x in jax.tree.leaves((state.params, state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim  # Adam's count and the like are not state bytes
            for s in x.addressable_shards
            if s.device == dev
        )
        ratios.append(got / want)
        del state
    return {
        "expert_parallel_state_bytes_over_formula": ratios,
        "expert_parallel_zero_stages": list(formula),
        "params_dense_experts": [dense, experts],
    }


def main() -> None:
    out = {**state_bytes(), **all_to_all(), **step_times()}
    out["shapes"] = {"d_model": D, "expert_ffn": F, "experts": E, "top_k": 2, "layers": LAYERS, "seq": SEQ}
    out["batch"] = BATCH
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
