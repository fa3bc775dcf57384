"""Train the demo GPT as one process of a multi-node job; checkpoint to shared storage and resume from it on restart.

    srun python examples/cluster_gpt.py --checkpoint-dir /shared/ckpt/gpt     # see examples/slurm/train_gpt.sbatch
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/cluster_gpt.py ...    # torchrun's variables work too
    kubectl apply -f examples/k8s/jobset.yaml                                 # a JobSet of Indexed Jobs

`openhosti_jax.mesh.initialize_distributed` finds the launcher (torchrun, SLURM, Open MPI, an Indexed Job with
``OPENHOSTI_COORDINATOR``, ``openhosti launch``) and joins the job; FSDP then spans every device of every process.
Run it under ``openhosti run`` so a crashed job is restarted; every restart resumes from the latest good checkpoint.
``--cpu-devices N`` rehearses on CPU (N simulated devices per process). Every process prints one
``RESULT {json}`` line: its launcher, process index and count, the step it started from and its losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", required=True, help="shared by every process; resumed from on start")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--batch", type=int, default=64, help="global batch in sequences (default 64)")
    parser.add_argument("--sequences", type=int, default=4096, help="corpus size in sequences (default 4096)")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="save every N steps (default 100)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--plan", default="fsdp", help="fsdp | dp | zero1 | zero2 (default fsdp)")
    parser.add_argument("--cpu-devices", type=int, default=None, help="rehearse on CPU with N devices per process")
    args = parser.parse_args(argv)
    if args.cpu_devices is not None:  # must be fixed before jax starts its backend
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={args.cpu_devices}"])

    from openhosti_jax.mesh import initialize_distributed
    from openhosti_jax.mesh.distributed import detect_launch

    initialize_distributed()  # a no-op when this is the only process

    import jax

    from openhosti_jax.demo.gpt_job import GPTJob, build_job, kept_plan, plan_meta
    from openhosti_jax.mesh import MeshConfig
    from openhosti_jax.models.gpt import GPTConfig
    from openhosti_jax.train import Trainer, TrainerCheckpoint

    found = detect_launch()
    launcher = found.launcher if found is not None else "none"
    first = jax.process_index() == 0
    index, count = jax.process_index(), jax.process_count()
    print(f"{launcher}: process {index}/{count} pid {os.getpid()}, {jax.device_count()} devices", flush=True)
    heads = max(1, args.d_model // 64)
    job = GPTJob(
        model=GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_heads=heads, n_layers=args.layers),
        steps=args.steps,
        global_batch=args.batch,
        num_sequences=args.sequences,
        plan=int(args.plan) if args.plan.isdigit() else args.plan,
        mesh=MeshConfig(data=1, fsdp=-1),
        progress=first and sys.stderr.isatty(),
    )
    # Saves by step count only: every process reaches the same decision at the same step. (A time-based schedule
    # is read from each process's own clock, and processes that disagree on a save wait for each other forever.)
    checkpoint = TrainerCheckpoint(
        os.path.abspath(args.checkpoint_dir), every_minutes=None, every_steps=args.checkpoint_every
    )
    keep, note = kept_plan(checkpoint, job)  # a resumed run keeps the plan it saved
    state, plan, step, data = build_job(job, None, keep)
    if note:
        step.report.record(note)
    checkpoint.meta.update(plan_meta(plan))
    if first:
        print(step.report, flush=True)
    trainer = Trainer(step, progress=job.progress, checkpoint=checkpoint, learning_rate=job.learning_rate)
    result = trainer.fit(state, data, num_steps=job.steps)
    losses = [h["loss"] for h in result.history]
    start = result.history[0]["step"] - 1 if result.history else args.steps
    record = {
        "launcher": launcher,
        "process": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "start": start,
        "losses": losses,
    }
    print("RESULT " + json.dumps(record), flush=True)
    return 130 if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
