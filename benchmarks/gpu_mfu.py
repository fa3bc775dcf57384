"""Model FLOPs utilisation of the GPT demo scaled to ~1B parameters (bf16) on whatever accelerator is present.

"ours": the planner's plan (``plan="auto"``), the
microbatch chosen by `find_microbatch` (AOT compiles against the device memory budget), the `@spmd` step.
"plain_jit": the same model and batch as one ``jax.jit`` data-parallel step (replicated params and Adam state,
batch split over every device, no accumulation). Both are timed in the same process, alternated, medians.

    python benchmarks/gpu_mfu.py            # ~1B GPT on the GPU(s): a few minutes on one H100/H200
    python benchmarks/gpu_mfu.py --quick    # tiny GPT, 2 repeats, on the accelerator present (else 8 CPU devices)
    python benchmarks/gpu_mfu.py --dry-run  # tiny GPT on 8 simulated CPU devices (tests)

MFU = flops_per_token * tokens_per_s / (devices * peak FLOP/s), ``flops_per_token`` counting causal attention half
(`openhosti_jax.flops.CAUSAL_ATTENTION_COUNTED`, as MaxText and Megatron-LM count). The peak is the vendor's dense
bf16 figure for known GPUs (H100/H200 989 TFLOP/s, A100 312), else ``--peak-tflops``, else a measured bf16 matmul
(CPU).
Last stdout line: one JSON object (`goals.emit`; benchmarks/README.md: no goal is asserted for the gpu_*.py
scripts) with mfu, plain_jit_mfu, tokens_per_s, peak_memory_bytes and more. On a CPU the MFU is against a
measured matmul, not a vendor peak: it checks the code paths, not an accelerator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import goals

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny GPT on 8 simulated CPU devices")
    p.add_argument("--quick", action="store_true", help="tiny GPT on the accelerator present (else CPU devices)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default 16; tiny 16)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 4; tiny 2)")
    p.add_argument("--repeats", type=int, default=None, help="alternated repeats (default 3; quick 2)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak bf16 TFLOP/s override")
    args = p.parse_args(argv)
    args.small = args.dry_run or args.quick
    args.repeats = args.repeats or (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from openhosti_jax import MeshConfig, build_mesh, create_train_state, spmd
    from openhosti_jax.demo.gpt_job import gpt_loss_sum_fn
    from openhosti_jax.microbatch import compiled_peak_bytes, find_microbatch, make_train_step
    from openhosti_jax.models.gpt import GPT, GPTConfig, make_corpus, next_token_loss

    if args.small:
        cfg = GPTConfig.tiny(dtype="bfloat16")
    else:
        cfg = GPTConfig(vocab_size=256, seq_len=1024, d_model=2048, n_heads=16, n_layers=20, dtype="bfloat16")
    batch_size = args.batch or 16
    steps = args.steps or (2 if args.small else 4)
    devices = jax.devices()
    n_dev = len(devices)
    tokens_np = make_corpus(batch_size, cfg.seq_len)
    tx = optax.adamw(1e-4)
    strategy = "auto"

    # ours: planner's plan + microbatch search by AOT compiles
    mesh = build_mesh(MeshConfig(data=1, fsdp=-1), devices)
    state, plan = create_train_state(lambda r: GPT(cfg, rngs=nnx.Rngs(r)), tx, mesh, plan=strategy)
    per_device = batch_size // plan.data_parallel_size
    abstract_batch = {"tokens": jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)}
    steps_by_size = {}

    def compile_for(size: int) -> jax.stages.Compiled:
        n_micro = -(-per_device // size)
        loss_sum_fn = gpt_loss_sum_fn(state.apply_fn, state.model_state)
        steps_by_size[size] = spmd(make_train_step(loss_sum_fn, n_micro), mesh=mesh, plan=plan)
        return steps_by_size[size].lower(state, abstract_batch).compile()

    t0 = time.perf_counter()
    choice = find_microbatch(compile_for, per_device)
    search_s = time.perf_counter() - t0
    ours_step = steps_by_size[choice.size]
    state, ours_batch = ours_step.place(state, {"tokens": tokens_np})
    ours_fn = choice.compiled

    # plain jit data parallel: replicated params and optimizer state
    dp_mesh = build_mesh(MeshConfig(data=-1), devices)
    repl, rows = NamedSharding(dp_mesh, P()), NamedSharding(dp_mesh, P("data"))
    graphdef, _, rest = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)

    def init_plain(key: jax.Array) -> tuple:
        params = nnx.split(GPT(cfg, rngs=nnx.Rngs(key)), nnx.Param, ...)[1]
        return params, tx.init(params)

    def plain_step(params, opt_state, tokens):
        def loss(p):
            logits = nnx.merge(graphdef, p, rest)(tokens)
            total, count = next_token_loss(logits, tokens)
            return total / count

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    plain_params, plain_opt = jax.jit(init_plain, out_shardings=repl)(jax.random.key(0))
    plain_tokens = jax.device_put(tokens_np, rows)
    plain_error = None
    try:
        plain_fn = (
            jax.jit(plain_step, out_shardings=repl, donate_argnums=(0, 1))
            .lower(plain_params, plain_opt, plain_tokens)
            .compile()
        )
    except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED: the plain step does not fit; report it
        plain_fn, plain_error = None, f"{type(e).__name__}: {str(e)[:200]}"

    def run_ours(k: int) -> float:
        nonlocal state
        t = time.perf_counter()
        for _ in range(k):
            state, m = ours_fn(state, ours_batch)
        jax.block_until_ready(m["loss"])
        return (time.perf_counter() - t) / k

    def run_plain(k: int) -> float:
        nonlocal plain_params, plain_opt
        t = time.perf_counter()
        for _ in range(k):
            plain_params, plain_opt, v = plain_fn(plain_params, plain_opt, plain_tokens)
        jax.block_until_ready(v)
        return (time.perf_counter() - t) / k

    run_ours(1)  # warm-up (first execution, allocator)
    if plain_fn is not None:
        run_plain(1)
    ours_t, plain_t = [], []
    for _ in range(args.repeats):
        ours_t.append(run_ours(steps))
        if plain_fn is not None:
            plain_t.append(run_plain(steps))

    kind = devices[0].device_kind
    known = next((v for k, v in PEAK_BF16_TFLOPS.items() if k.lower() in kind.lower()), None)
    if args.peak_tflops is not None:
        peak, source = args.peak_tflops * 1e12, "--peak-tflops"
    elif known is not None and devices[0].platform == "gpu":
        peak, source = known * 1e12, f"vendor dense bf16 peak for {kind}"
    else:
        peak, source = measured_matmul_flops(jax, jnp, devices[0], 512 if args.small else 8192), "measured matmul"
    tokens = batch_size * cfg.seq_len
    flops_tok = cfg.flops_per_token()
    tps = tokens / statistics.median(ours_t)
    plain_tps = tokens / statistics.median(plain_t) if plain_t else None
    stats = [d.memory_stats() or {} for d in devices] if devices[0].platform != "cpu" else []
    runtime_peak = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
    result = {
        "mfu": flops_tok * tps / (n_dev * peak),
        "plain_jit_mfu": flops_tok * plain_tps / (n_dev * peak) if plain_tps else None,
        "tokens_per_s": tps,
        "plain_jit_tokens_per_s": plain_tps,
        "peak_memory_bytes": runtime_peak or choice.peak_bytes,
        "peak_memory_source": "device memory_stats peak_bytes_in_use" if runtime_peak else "compiled step",
        "compiled_peak_bytes": compiled_peak_bytes(choice.compiled),
        "params": cfg.num_params(),
        "flops_per_token": flops_tok,
        "peak_flops_per_device": peak,
        "peak_flops_source": source,
        "devices": n_dev,
        "device_kind": kind,
        "global_batch": batch_size,
        "seq_len": cfg.seq_len,
        "plan": strategy,
        "zero_stage": plan.zero_stage,
        "microbatch": choice.size,
        "num_microbatches": choice.num_microbatches,
        "microbatch_compiles": choice.compiles,
        "microbatch_search_s": search_s,
        "step_times_s": ours_t,
        "plain_jit_step_times_s": plain_t,
        "plain_jit_error": plain_error,
        "dry_run": args.dry_run,
        "platform": devices[0].platform,
    }
    goals.emit(result, __file__)
    return 0


def measured_matmul_flops(jax, jnp, device, n: int) -> float:  # noqa: ANN001 - modules passed after env setup
    """Best-of-5 FLOP/s of an ``n x n`` bf16 matmul on ``device`` (the achievable peak where none is known)."""
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


if __name__ == "__main__":
    sys.exit(main())
