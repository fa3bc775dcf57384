"""Remat and precision policies on a real accelerator: compiled memory, measured step time, the planner's prediction.

For the bundled GPT (scanned and unrolled blocks) on one device, each (layout, remat, precision) is compiled with
the library's step (`openhosti_jax.spmd`), its temporaries read from ``memory_analysis()``, a few steps timed
(median), and the cost model's predicted bytes and seconds for the same plan printed beside them (device profile
``--profile``). Each result is also appended to ``$OUT/gpu_memory.jsonl`` (when ``OUT`` is set) as it comes, so a
run cut short keeps what it measured.

    python benchmarks/gpu_memory.py            # d_model 1024, 12 layers, seq 1024: a few minutes on one H100/H200
    python benchmarks/gpu_memory.py --quick    # a tiny GPT, 2 timed steps, on the accelerator present: the 5
                                               # configurations the ratios need (on a CPU: scanned remat only)
    python benchmarks/gpu_memory.py --dry-run  # the same tiny GPT, every configuration, forced onto the CPU

Last stdout line: one JSON object (`goals.emit`; benchmarks/README.md: no goal is asserted for the gpu_*.py
scripts), ``runs`` (one entry per configuration) and the ratios ``remat_full_temp_over_none`` (scanned and
unrolled), ``bf16_step_over_fp32`` and ``remat_full_step_over_none``. On a CPU the step times (and so their
ratios) say nothing about an accelerator; the compiled bytes still do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import goals


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="a tiny GPT on CPU")
    p.add_argument("--quick", action="store_true", help="a tiny GPT on the accelerator present (CPU if none)")
    p.add_argument("--profile", default="H200", help="device profile the predictions use (default H200)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 3; tiny 2)")
    args = p.parse_args(argv)
    args.small = args.dry_run or args.quick
    args.steps = args.steps or (2 if args.small else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import optax
    from flax import nnx

    from openhosti_jax import MeshConfig, build_mesh, create_train_state, spmd
    from openhosti_jax.demo.examples import gpt_step
    from openhosti_jax.models.gpt import GPT, GPTConfig
    from openhosti_jax.planner.cost import estimate
    from openhosti_jax.planner.profiles import PROFILES
    from openhosti_jax.planner.workload import workload
    from openhosti_jax.policies.optimizers import optimizer_for
    from openhosti_jax.policies.remat import has_host_memory
    from openhosti_jax.sharding.plan import ShardingPlan

    if args.small:
        shape = {"d_model": 32, "n_heads": 2, "n_layers": 2, "seq_len": 32}
        batch_size = 4
    else:
        shape = {"d_model": 1024, "n_heads": 16, "n_layers": 12, "seq_len": 1024}
        batch_size = 16
    device = jax.devices()[0]
    mesh = build_mesh(MeshConfig(data=1), [device])
    tx = optax.adam(1e-4)
    tokens = jax.random.randint(jax.random.key(0), (batch_size, shape["seq_len"]), 0, 256)
    remats = ["none", "dots", "full"] + (["offload"] if has_host_memory([device]) else [])
    configs = [(True, r, "fp32") for r in remats] + [(True, "none", "bf16"), (True, "full", "bf16")]
    configs += [(False, "none", "fp32"), (False, "full", "fp32")]
    skipped = None
    if args.quick and device.platform == "cpu":
        # a CPU's step times say nothing about an accelerator: the scanned GPT's remat, for the compiled bytes only
        configs = [(True, "none", "fp32"), (True, "full", "fp32")]
        skipped = "quick mode on CPU: bf16 and the unrolled layout skipped (their ratios are step times or repeat"
        skipped += " the scanned one's bytes); only the scanned GPT's remat none/full compiled and run"
    elif args.quick:  # the configurations the summary's ratios need
        configs = [c for c in configs if c[1] in ("none", "full") and c != (True, "full", "bf16")]
    out_dir = os.environ.get("OUT")
    runs: list[dict[str, Any]] = []
    for scan, remat, prec in configs:
        cfg = GPTConfig(**shape, scan_layers=scan)
        init = lambda r, cfg=cfg: GPT(cfg, rngs=nnx.Rngs(r))  # noqa: E731
        work = workload(init, jax.ShapeDtypeStruct(tokens.shape, tokens.dtype))
        wrapped = optimizer_for(tx, prec)
        plan = ShardingPlan.from_zero(work.params, wrapped, {"data": 1}, 0, remat=remat, precision=prec)
        predicted = estimate(plan, work, wrapped, PROFILES[args.profile])
        state, _ = create_train_state(init, tx, mesh, plan=plan)
        step = spmd(gpt_step, mesh=mesh, plan=plan)
        state, batch = step.place(state, tokens)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()  # the program both measured and timed: one compile
        compile_s = time.perf_counter() - t0
        memory = compiled.memory_analysis()
        state, metrics = compiled(state, batch)  # first step
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t0)
        run = {
            "layout": "scan" if scan else "list",
            "remat": remat,
            "precision": prec,
            "temp_bytes": memory.temp_size_in_bytes,
            "argument_bytes": memory.argument_size_in_bytes,
            "host_temp_bytes": getattr(memory, "host_temp_size_in_bytes", 0),
            "step_seconds": statistics.median(times),
            "predicted_seconds": predicted.seconds,
            "predicted_bytes": predicted.bytes,
            "compiled_bytes": memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes,
            "loss": float(metrics["loss"]),
            "compile_seconds": round(compile_s, 1),
        }
        runs.append(run)
        print(json.dumps(run), flush=True)
        if out_dir:
            with open(os.path.join(out_dir, "gpu_memory.jsonl"), "a") as f:
                f.write(json.dumps(run) + "\n")
        del state, step, compiled

    def find(layout: str, remat: str, prec: str = "fp32") -> dict[str, Any]:
        return next((r for r in runs if (r["layout"], r["remat"], r["precision"]) == (layout, remat, prec)), {})

    def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
        return a[key] / b[key] if a and b else None  # None: a configuration skipped

    summary = {
        "device": str(device.device_kind),
        "platform": device.platform,
        "params": GPTConfig(**shape).num_params(),
        "global_batch": batch_size,
        "remat_full_temp_over_none": ratio(find("scan", "full"), find("scan", "none"), "temp_bytes"),
        "remat_full_temp_over_none_unrolled_list": ratio(find("list", "full"), find("list", "none"), "temp_bytes"),
        "remat_full_step_over_none": ratio(find("scan", "full"), find("scan", "none"), "step_seconds"),
        "bf16_step_over_fp32": ratio(find("scan", "none", "bf16"), find("scan", "none"), "step_seconds"),
        "predicted_over_measured_seconds": [r["predicted_seconds"] / r["step_seconds"] for r in runs],
        "predicted_over_compiled_bytes": [r["predicted_bytes"] / r["compiled_bytes"] for r in runs],
        "runs": runs,
        **({"skipped": skipped} if skipped else {}),
    }
    goals.emit(summary, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
