"""Train a small GPT on 8 simulated CPU devices: automatic sharding plan printed, progress shown, checkpoints written.

    python examples/train_gpt.py --steps 200 --run-dir runs/gpt

Re-running the same command resumes from the latest checkpoint in ``--run-dir``, with the plan it was saved with.
Warnings and library log lines go to ``<run-dir>/log.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--batch", type=int, default=32, help="global batch in sequences (default 32)")
    parser.add_argument(
        "--plan", default="auto", help="auto (the planner picks mesh and ZeRO stage) | fsdp | dp | zero1 | zero2"
    )
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--run-dir", default="runs/gpt", help="metrics.jsonl and checkpoints/ go here")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="also save every N steps (default 50)")
    parser.add_argument("--replan", action="store_true", help="on resume, plan again instead of keeping the plan")
    args = parser.parse_args(argv)

    # The device count must be fixed before jax is imported.
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from openhosti_jax.demo.gpt_job import GPTJob, run_job
    from openhosti_jax.models.gpt import GPTConfig

    job = GPTJob(
        model=GPTConfig(seq_len=64, d_model=128, n_heads=4, n_layers=2),
        steps=args.steps,
        global_batch=args.batch,
        plan=args.plan if not args.plan.isdigit() else int(args.plan),
        metrics_path=os.path.join(args.run_dir, "metrics.jsonl"),
        checkpoint_dir=os.path.abspath(os.path.join(args.run_dir, "checkpoints")),
        checkpoint_every_steps=args.checkpoint_every,
        log_path=os.path.join(args.run_dir, "log.txt"),
        replan=args.replan,
    )
    result = run_job(job)
    losses = [h["loss"] for h in result.history]
    if losses:
        print(f"trained {len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; run dir {args.run_dir}")
    elif not result.interrupted:
        print(f"nothing to train: the run in {args.run_dir} already reached {args.steps} steps (raise --steps)")
    return 130 if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
