"""The ``openhosti`` command: train the demo, print a plan, draw a run's report, run benchmarks, launch jobs.

    openhosti train --steps 50 --run-dir runs/gpt     # GPT demo on 8 simulated CPU devices
    openhosti report runs/gpt                         # PNGs in runs/gpt/report/
    openhosti plan --example gpt                      # the planner's report for the demo model
    openhosti bench planner                           # benchmarks/planner.py (source checkout)
    openhosti launch -n 2 -- python train.py          # N local processes, one coordinator
    openhosti run -- python train.py                  # restart on failure (resumes from checkpoints)

Exit codes: 0 success; 1 the job, benchmark or command failed; 2 usage error (bad flags, missing run
directory, unknown benchmark, a feature not installed); 130 interrupted (Ctrl-C, checkpoint written).

jax backends start only inside the subcommands, after ``--devices`` has set ``XLA_FLAGS``.

Example:
    >>> from openhosti_jax.cli import main
    >>> main(["bench", "no-such-benchmark"])
    2
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from openhosti_jax.errors import ConfigError, OpenhostiError, UsageError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
"""Where ``openhosti bench NAME`` looks for ``NAME.py`` (present in a source checkout only)."""

_EPILOG = """exit codes:
  0    success
  1    the job, benchmark or launched command failed
  2    usage error: bad flags, missing run directory, unknown benchmark, feature not installed
  130  interrupted (Ctrl-C); a checkpoint was written when --checkpoint-dir was given
"""


MAX_SIMULATED_DEVICES = 4096
"""The most simulated CPU devices ``--devices`` / ``--local-devices`` may ask for."""
MAX_LOCAL_PROCESSES = 1024
"""The most processes ``openhosti launch -n`` starts on one machine."""
MAX_INT = 1 << 40
"""The largest count any flag takes (steps, batch, widths): a larger one is a typing slip."""


def _count(low: int = 1, high: int = MAX_INT) -> Callable[[str], int]:
    """An argparse type: an ASCII integer in ``low..high`` (argparse says what was wrong and exits 2)."""

    def parse(text: str) -> int:
        t = text.strip()
        digits = t[1:] if t[:1] in "+-" else t
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 20 or not low <= int(t) <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high:,}, found {text!r}")
        return int(t)

    return parse


def _number(low: float = 0.0, *, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float ``>= low`` (``> low`` with ``strict``); nan and inf are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (strict and value == low):
            bound = f"> {low:g}" if strict else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, found {text!r}")
        return value

    return parse


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public API says whether backends exist yet

    return xla_bridge.backends_are_initialized()


def _use_devices(count: int, accelerator: bool) -> list[Any]:
    """The first ``count`` devices; on CPU forces ``count`` simulated devices if no backend has started yet."""
    if count < 1:
        raise UsageError(f"--devices must be >= 1, found {count}")
    if not accelerator and count > MAX_SIMULATED_DEVICES:
        raise UsageError(f"--devices: expected at most {MAX_SIMULATED_DEVICES} simulated CPU devices, found {count}")
    if not accelerator and not _backends_started():
        flags = os.environ.get("XLA_FLAGS", "").split()
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        jax.config.update("jax_platforms", "cpu")
    import jax

    devices = jax.devices()
    if len(devices) < count:
        raise UsageError(
            f"--devices {count} asked for, found {len(devices)} {devices[0].platform} devices; jax started its "
            "backend before the device count could be set: run `openhosti` in a fresh process or pass fewer devices"
        )
    return devices[:count]


def _import(module: str, attr: str) -> Callable[..., Any]:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{module}.{attr} is not available in this install ({e}); update openhosti_jax") from e


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError(f"`openhosti {args.command}` needs a command after `--`, e.g. -- python train.py")
    return cmd


def cmd_train(args: argparse.Namespace) -> int:
    """Train the GPT demo; with ``--run-dir`` write metrics.jsonl, plan.txt, plan.json there."""
    devices = _use_devices(args.devices, args.accelerator)
    import jax

    from openhosti_jax.demo.gpt_job import GPTJob, build_resumable_job
    from openhosti_jax.mesh import MeshConfig, build_mesh
    from openhosti_jax.models.gpt import GPTConfig
    from openhosti_jax.report.memory import plan_record
    from openhosti_jax.report.rundir import LOG, METRICS, PLAN_JSON, PLAN_TXT, write_json
    from openhosti_jax.train import Trainer, TrainerCheckpoint
    from openhosti_jax.train.logs import log_to_file
    from openhosti_jax.train.profiling import ProfileWindow
    from openhosti_jax.train.writers import TensorBoardWriter

    run_dir = args.run_dir
    if (args.tensorboard or args.profile_steps) and not run_dir:
        raise UsageError("--tensorboard and --profile-steps write into --run-dir; give one")
    profile = ProfileWindow.parse(args.profile_steps, os.path.join(run_dir, "profile")) if args.profile_steps else None
    metrics = args.metrics or (os.path.join(run_dir, METRICS) if run_dir else None)
    ckpt_dir = args.checkpoint_dir or (os.path.join(run_dir, "checkpoints") if run_dir and args.checkpoint else None)
    model = GPTConfig.tiny(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers)
    job = GPTJob(
        model=model,
        steps=args.steps,
        global_batch=args.batch,
        num_sequences=max(args.num_sequences, args.batch),
        learning_rate=args.lr,
        plan=int(args.plan) if args.plan.isdigit() else args.plan,
        seed=args.seed,
        metrics_path=metrics,
        progress=not args.no_progress,
        print_plan=False,
        replan=args.replan,
    )
    checkpoint = None
    if ckpt_dir:
        checkpoint = TrainerCheckpoint(
            os.path.abspath(ckpt_dir), every_steps=args.checkpoint_every, replicate_to=args.replicate_to
        )
    mesh = build_mesh(MeshConfig(data=1, fsdp=-1), devices)
    state, _, step, data = build_resumable_job(job, mesh, checkpoint)
    text = str(step.report)
    print(text)
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        Path(run_dir, PLAN_TXT).write_text(text + "\n")
        batch = {"tokens": jax.ShapeDtypeStruct((job.global_batch, model.seq_len), jax.numpy.int32)}
        compiled = step.lower(state, batch).compile()
        write_json(run_dir, PLAN_JSON, plan_record(step.report, state, compiled))
    writers = [TensorBoardWriter(os.path.join(run_dir, "tensorboard"))] if args.tensorboard else []
    trainer = Trainer(
        step,
        metrics_path=metrics,
        writers=writers,
        progress=job.progress,
        log_every=args.log_every,
        checkpoint=checkpoint,
        learning_rate=job.learning_rate,
        profile=profile,
    )
    if run_dir:
        with log_to_file(os.path.join(run_dir, LOG)):
            result = trainer.fit(state, data, num_steps=job.steps)
    else:
        result = trainer.fit(state, data, num_steps=job.steps)
    if run_dir and checkpoint is not None:
        from openhosti_jax.report.rundir import CHECKPOINTS, append_jsonl

        for saved_step, blocking_s in checkpoint.save_times:
            append_jsonl(run_dir, CHECKPOINTS, {"step": saved_step, "blocking_s": blocking_s})
    losses = [h["loss"] for h in result.history]
    if losses:
        print(f"trained {len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    elif not result.interrupted:
        print(f"nothing to train: the checkpoint already reached {job.steps} steps (raise --steps)")
    if run_dir:
        print(f"run directory: {run_dir} (draw it with `openhosti report {run_dir}`)")
    return EXIT_INTERRUPTED if result.interrupted else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the planner's report for a bundled example model."""
    devices = _use_devices(args.devices, args.accelerator)
    plan_example = _import("openhosti_jax.demo.examples", "plan_example")
    _, report, header = plan_example(args.example, devices=devices, memory_budget=args.memory_budget)
    print(header)
    print(report)
    return EXIT_OK


def _global_batch(text: str, seq: int) -> int:
    """Sequences in the global batch: ``"1536"`` sequences, or tokens with a ``tok`` suffix (``"4Mtok"``)."""
    scale = {"": 1, "k": 2**10, "m": 2**20}
    low = text.strip().lower()

    def digits(t: str) -> bool:
        return t.isascii() and t.isdigit() and len(t) <= 15

    if low.endswith("tok"):
        number, unit = (low[:-4], low[-4]) if low[-4:-3] in ("k", "m") else (low[:-3], "")
        if not digits(number) or int(number) < 1 or (int(number) * scale[unit]) % seq:
            raise UsageError(f"--global-batch {text!r}: tokens must be a whole number of {seq}-token sequences")
        return int(number) * scale[unit] // seq
    if not digits(low) or int(low) < 1:
        raise UsageError(f"--global-batch {text!r}: expected sequences (e.g. 1536) or tokens (e.g. 4Mtok)")
    return int(low)


def cmd_predict(args: argparse.Namespace) -> int:
    """Predict step time, throughput, MFU and memory of a model on a cluster that is not attached."""
    import optax

    presets = _import("openhosti_jax.models.presets", "model_preset")
    shape = _import("openhosti_jax.models.presets", "llama_shape")
    predict = _import("openhosti_jax.planner.predict", "predict")
    dims = {k: getattr(args, k) for k in ("layers", "d_model", "heads", "ffn", "vocab", "seq")}
    unused = [f"--{k.replace('_', '-')}" for k in ("layers", "d_model", "heads", "kv_heads", "ffn", "vocab")]
    unused = [f for f in unused if getattr(args, f[2:].replace("-", "_")) is not None]
    if args.model is not None and unused:
        raise UsageError(f"{', '.join(unused)} do not apply with --model (only --seq does); drop them or --model")
    if args.mesh is None:
        fixed = {"--zero": args.zero is not None, "--microbatch": args.microbatch is not None}
        fixed["--virtual"] = args.virtual != 1
        if any(fixed.values()):
            raise UsageError(
                f"{', '.join(k for k, v in fixed.items() if v)} fix a configuration: they apply with --mesh only"
            )
    if args.model is not None:
        model = presets(args.model, **({"seq_len": args.seq} if args.seq is not None else {}))
    elif all(v is not None for v in dims.values()):
        model = shape(kv_heads=args.kv_heads, **dims)
    else:
        missing = [f"--{k.replace('_', '-')}" for k, v in dims.items() if v is None]
        raise UsageError(f"give --model NAME or every dimension (missing {', '.join(missing)})")
    seq = model.tokens_per_example
    examples = _global_batch(args.global_batch, seq)
    batch = model.sample_batch(examples)
    where = _import("openhosti_jax.planner.cluster", "cluster")(args.cluster)
    if args.stack is not None:
        where = dataclasses.replace(where, stack=_import("openhosti_jax.planner.stacks", "stack")(args.stack))
    result = predict(
        model.init,
        optax.adamw(1e-4),
        batch,
        where,
        mesh=args.mesh,
        zero=args.zero,
        remat=args.remat,
        precision=args.precision,
        microbatches=args.microbatch or 1,
        virtual=args.virtual,
        pipeline=not args.no_pipeline,
        model_flops_per_token=model.flops_per_token,
        memory_budget=None if args.memory_budget is None else int(args.memory_budget * 2**30),
        compile=args.compile,
        step_fn=_preset_step(model) if args.compile else None,
    )
    if args.compile and result.plan.pipeline_stages > 1 and result.compiled is None:
        result = _compile_pipelined(result, model, batch)
    if args.json:
        print(json.dumps({"model": model.name, "global_batch": examples, **result.as_dict()}))
    else:
        print(f"{'model':<20} {model.name}: {model.config.num_params() / 1e9:.2f}B parameters, {seq} positions each")
        print(f"{'global batch':<20} {examples} examples ({examples * seq:,} positions)")
        print(result)
    return EXIT_OK


def _compile_pipelined(result: Any, model: Any, batch: Any) -> Any:
    """``result`` with its pipelined plan's step (next-token loss over the pipeline's stages) compiled for the TPU
    target it was predicted on (`openhosti_jax.train.pipelined.lower_pipelined`); as it was where the cluster is no
    TPU target."""
    import optax

    aot = importlib.import_module("openhosti_jax.planner.aot")
    target = aot.cluster_target(result.cluster)
    if target is None or not hasattr(model.config, "vocab_size"):
        return result
    next_token_loss = _import("openhosti_jax.models.gpt", "next_token_loss")

    def mean_loss(logits: Any, tokens: Any) -> Any:
        total, count = next_token_loss(logits, tokens)
        return total / count

    axes = importlib.import_module("openhosti_jax.mesh.config").AXES
    mesh = _import("openhosti_jax.mesh.topology", "target_mesh")(target, dict(result.plan.mesh_shape), axes)
    lowered = aot.lower_for(
        lambda: _import("openhosti_jax.train.pipelined", "lower_pipelined")(
            model.init, optax.adamw(1e-4), mesh, result.plan, (batch, batch), mean_loss
        ),
        target,
        "the pipelined plan",
    )
    check = aot.compile_check(lowered, target, "the pipelined plan", predicted_bytes=result.memory_bytes)
    return dataclasses.replace(result, compiled=check)


def _preset_step(model: Any) -> Callable[..., Any] | None:
    """The library's own training step for a preset: next-token prediction for a language model (with the MoE
    layers' auxiliary loss for a mixture of experts), None (the planner's default step) for the others."""
    cfg = model.config
    if hasattr(cfg, "sample_batch") or not (hasattr(cfg, "vocab_size") and hasattr(cfg, "n_layers")):
        return None  # a batch of more than tokens (BERT's fine-tuning batch), or no language model
    if getattr(cfg, "num_experts", 0):
        return _import("openhosti_jax.demo.examples", "moe_step")
    return _import("openhosti_jax.demo.examples", "token_train_step")


def cmd_report(args: argparse.Namespace) -> int:
    """Draw a run directory's figures."""
    if not os.path.isdir(args.run_dir):
        raise UsageError(f"expected a run directory, found nothing at {args.run_dir!r}; see `openhosti train -h`")
    from openhosti_jax.report.build import write_report

    schedule = None
    if args.schedule:
        schedule = {
            "kind": args.schedule,
            "num_stages": args.stages,
            "num_microbatches": args.microbatches,
            "num_virtual": args.virtual,
            "forward_times": 1.0,
        }
    rep = write_report(args.run_dir, args.out, schedule=schedule)
    for name, path in rep.figures.items():
        print(f"wrote {name:<12} {path}")
    for name, why in rep.skipped.items():
        print(f"skipped {name:<10} {why}")
    s = rep.summary
    if s.get("final_loss") is not None:
        print(f"{s['steps']} steps, loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}")
    return EXIT_OK


def _benchmarks() -> list[str]:
    """The benchmarks ``openhosti bench`` runs: the scripts of `BENCHMARKS_DIR` (not its goal-table reader)."""
    if not BENCHMARKS_DIR.is_dir():
        return []
    return sorted(p.stem for p in BENCHMARKS_DIR.glob("*.py") if p.is_file() and p.stem not in ("goals", "__init__"))


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/NAME.py`` from a source checkout; its last stdout line is one JSON object."""
    path = BENCHMARKS_DIR / f"{args.name}.py"
    if args.name not in _benchmarks():  # only a script of benchmarks/ (never a path: ../x, /tmp/y)
        available = _benchmarks()
        where = f"found {available} in {BENCHMARKS_DIR}" if available else "this install has no benchmarks/ folder"
        raise UsageError(
            f"expected a benchmark script benchmarks/{args.name}.py, {where}; benchmarks ship with the source "
            "checkout (git clone, then `pip install -e .`)"
        )
    rest = [a for a in args.args if a != "--"]
    return EXIT_OK if subprocess.call([sys.executable, str(path), *rest]) == 0 else EXIT_FAILURE


def cmd_launch(args: argparse.Namespace) -> int:
    """Start N local processes of a command wired to one jax.distributed coordinator."""
    launch_local = _import("openhosti_jax.mesh.launch", "launch_local")
    rc = launch_local(_command(args), args.num_processes, local_devices=args.local_devices, port=args.port)
    return EXIT_OK if rc == 0 else EXIT_FAILURE


def cmd_run(args: argparse.Namespace) -> int:
    """Run a command, restarting it when it fails (it resumes from its latest checkpoint)."""
    run_with_restarts = _import("openhosti_jax.checkpoint", "run_with_restarts")
    given = {"backoff_s": args.backoff_s, "backoff_factor": args.backoff_factor, "max_backoff_s": args.max_backoff_s}
    given["reset_after_s"] = args.reset_after_s
    kw = {k: v for k, v in given.items() if v is not None}
    rc = run_with_restarts(_command(args), max_restarts=args.max_restarts, **kw)  # bad options: ConfigError, exit 2
    return EXIT_OK if rc == 0 else EXIT_FAILURE


def _device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--devices", type=_count(1, MAX_INT), default=8, help="devices to use; simulated CPU devices (default 8)"
    )
    p.add_argument("--accelerator", action="store_true", help="use the GPU/TPU instead of simulated CPU devices")


def build_parser() -> argparse.ArgumentParser:
    """The ``openhosti`` argument parser (every subcommand documented in ``--help``)."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="openhosti", description=__doc__.split("Example:")[0], formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        help="train the GPT demo",
        epilog=_EPILOG,
        formatter_class=fmt,
        description="Train the bundled GPT on the bundled corpus; print the plan and progress.",
    )
    t.add_argument("--steps", type=_count(), default=50, help="optimizer steps (default 50)")
    t.add_argument("--batch", type=_count(), default=32, help="global batch in sequences (default 32)")
    t.add_argument("--plan", default="auto", help="auto (default: planned) | fsdp | dp | zero1 | zero2 | 0-3")
    t.add_argument("--run-dir", help="write metrics.jsonl, plan.txt, plan.json (and checkpoint times) here")
    t.add_argument("--metrics", help="JSONL metrics path (default RUN_DIR/metrics.jsonl)")
    t.add_argument("--checkpoint-dir", help="save checkpoints here and resume from the latest one")
    t.add_argument(
        "--replicate-to",
        help="copy each good checkpoint step here too (s3://..., gs://... or a path), in the background; a run whose "
        "--checkpoint-dir is empty or stale resumes from it",
    )
    t.add_argument("--checkpoint", action="store_true", help="checkpoint into RUN_DIR/checkpoints")
    t.add_argument("--checkpoint-every", type=_count(), default=None, help="also save every K steps")
    t.add_argument("--seq-len", type=_count(), default=32, help="tokens per sequence (default 32)")
    t.add_argument("--d-model", type=_count(), default=64, help="model width (default 64)")
    t.add_argument("--layers", type=_count(), default=2, help="transformer blocks (default 2)")
    t.add_argument("--num-sequences", type=_count(), default=2048, help="corpus size in sequences (default 2048)")
    t.add_argument("--lr", type=_number(0.0, strict=True), default=3e-3, help="Adam learning rate (default 3e-3)")
    t.add_argument("--seed", type=_count(0, 2**63 - 1), default=0, help="init / data seed (default 0)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--log-every", type=_count(), default=10, help="fetch and write metrics every N steps (default 10)")
    t.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to RUN_DIR/tensorboard")
    t.add_argument("--profile-steps", help="FIRST:LAST: a jax.profiler trace of those steps in RUN_DIR/profile")
    t.add_argument("--replan", action="store_true", help="on resume, plan again instead of keeping the saved plan")
    _device_flags(t)
    t.set_defaults(handler=cmd_train)

    p = sub.add_parser(
        "plan",
        help="print the sharding plan for an example model",
        epilog=_EPILOG,
        formatter_class=fmt,
        description="Plan a bundled example model and print the report.",
    )
    p.add_argument("--example", default="gpt", help="example model name (default gpt)")
    p.add_argument("--memory-budget", type=_count(), default=None, help="per-device bytes (default: device memory)")
    _device_flags(p)
    p.set_defaults(handler=cmd_plan)

    pr = sub.add_parser(
        "predict",
        help="predict step time, tokens/s, MFU and memory on a cluster you do not have yet",
        epilog=_EPILOG,
        formatter_class=fmt,
        description="Plan a model for a cluster from abstract shapes (nothing is allocated or compiled) and print "
        "the predicted step time, tokens/s per device, MFU and memory per device, for the planner's choice or a "
        "fixed configuration (--mesh and the flags after it).",
    )
    pr.add_argument(
        "--model",
        default=None,
        help="preset: gpt3-175b, bert-large, llama2-7b/70b, llama3-8b/70b/405b, mixtral-8x7b, deepseek-moe-16b, "
        "sdxl-unet",
    )
    for flag in ("layers", "d-model", "heads", "kv-heads", "ffn", "vocab", "seq"):
        pr.add_argument(
            f"--{flag}", type=_count(), default=None, help=f"model {flag} (without --model; --seq also with)"
        )
    pr.add_argument("--cluster", required=True, help="e.g. 8xH100, 64xH100 (8 hosts of 8), 8x8xA100, v5p-128")
    pr.add_argument("--global-batch", required=True, help="sequences (1536) or tokens (4Mtok, 4194304tok)")
    pr.add_argument("--mesh", default=None, help="fixed axis sizes, e.g. fsdp=8 or stage=8,tensor=8")
    pr.add_argument("--zero", type=_count(0, 3), default=None, choices=[0, 1, 2, 3], help="ZeRO stage (with --mesh)")
    pr.add_argument("--remat", default=None, help="none, dots, selective, full or offload")
    pr.add_argument("--precision", default=None, help="fp32, bf16, bf16_params")
    pr.add_argument("--microbatch", type=_count(), default=None, help="microbatches per step (with --mesh)")
    pr.add_argument("--virtual", type=_count(), default=1, help="interleaved chunks per pipeline stage (with --mesh)")
    pr.add_argument(
        "--stack",
        default=None,
        help="software that runs the step: openhosti (default), megatron-core, megatron-2021, torchtitan, "
        "torchtitan-compile, maxtext (TPU), maxtext-gpu",
    )
    pr.add_argument("--no-pipeline", action="store_true", help="do not consider pipelined meshes")
    pr.add_argument(
        "--memory-budget", type=_number(0.0, strict=True), default=None, help="GiB per device (default: the device's)"
    )
    pr.add_argument(
        "--compile",
        action="store_true",
        help="compile the plan ahead of time for a TPU cluster (v5p-128, 2xv5p-256; needs the tpu extra, no TPU) and "
        "report compiled beside predicted bytes; a GPU cluster stays a forecast",
    )
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    pr.set_defaults(handler=cmd_predict)

    r = sub.add_parser(
        "report",
        help="draw PNG figures from a run directory",
        epilog=_EPILOG,
        formatter_class=fmt,
        description="Loss, throughput, memory (predicted vs compiled), pipeline Gantt, balancer and "
        "checkpoint figures from RUN_DIR; a figure whose data is missing is skipped with a note.",
    )
    r.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `openhosti train --run-dir`")
    r.add_argument("--out", help="output directory (default RUN_DIR/report)")
    r.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved"),
        help="simulate this pipeline schedule when the run recorded none",
    )
    r.add_argument("--stages", type=_count(1, 4096), default=4, help="pipeline stages for --schedule (default 4)")
    r.add_argument("--microbatches", type=_count(1, 1 << 16), default=8, help="microbatches for --schedule (default 8)")
    r.add_argument("--virtual", type=_count(1, 256), default=1, help="chunks per stage for interleaved (default 1)")
    r.set_defaults(handler=cmd_report)

    b = sub.add_parser(
        "bench",
        help="run benchmarks/NAME.py (source checkout)",
        epilog=_EPILOG,
        formatter_class=fmt,
        description="Run a benchmark script; it prints one JSON object last.",
    )
    b.add_argument("name", metavar="NAME", help="benchmark name, e.g. planner, gpu_mfu")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    b.set_defaults(handler=cmd_bench)

    la = sub.add_parser(
        "launch",
        help="start N local processes of a command",
        epilog=_EPILOG,
        formatter_class=fmt,
        description="openhosti launch -n 2 -- python train.py",
    )
    la.add_argument(
        "-n", "--num-processes", type=_count(1, MAX_LOCAL_PROCESSES), required=True, help="processes to start"
    )
    la.add_argument(
        "--local-devices", type=_count(1, MAX_SIMULATED_DEVICES), default=None, help="simulated CPU devices per process"
    )
    la.add_argument(
        "--port", type=_count(1, 65535), default=None, help="coordinator port on 127.0.0.1 (default: a free one)"
    )
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    la.set_defaults(handler=cmd_launch)

    ru = sub.add_parser(
        "run",
        help="run a command with restarts on failure",
        epilog=_EPILOG,
        formatter_class=fmt,
        description="openhosti run -- python train.py   (restarts resume from checkpoints)\n\n"
        "Restarts the command until it exits 0 or the restarts run out, waiting longer each time; a SIGTERM or\n"
        "SIGINT is passed on to it and ends the supervision. Cluster use: around `srun` in\n"
        "examples/slurm/train_gpt.sbatch, around each pod's process in examples/k8s/jobset.yaml.",
    )
    ru.add_argument("--max-restarts", type=_count(0, 1 << 20), default=3, help="restarts before giving up (default 3)")
    ru.add_argument("--backoff-s", type=_number(), default=None, help="seconds before the first restart (default 5)")
    ru.add_argument(
        "--backoff-factor", type=_number(1.0), default=None, help="each wait is this times the last (default 2)"
    )
    ru.add_argument("--max-backoff-s", type=_number(), default=None, help="longest wait in seconds (default 300)")
    ru.add_argument(
        "--reset-after-s",
        type=_number(0.0, strict=True),
        default=None,
        help="a run this long before failing resets the restart count and backoff (default: never)",
    )
    ru.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    ru.set_defaults(handler=cmd_run)
    parser.epilog = _EPILOG
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``openhosti`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help exits 0, bad flags exit 2
        return int(e.code or 0)
    try:
        return args.handler(args)
    except ConfigError as e:  # a usage error, or an option the library refuses
        print(f"openhosti {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OpenhostiError as e:
        print(f"openhosti {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
