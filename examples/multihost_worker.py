"""Train the demo GPT as one process of a multi-process `jax.distributed` job (FSDP over every device of every process).

    openhosti launch -n 2 --local-devices 4 -- python examples/multihost_worker.py --steps 20

or, without the CLI, ``python -c "from openhosti_jax.mesh.launch import launch_local; ..."``. Each process loads only
its slice of every global batch; process 0 prints the plan and progress. Every process prints one
``RESULT {json}`` line with its per-step losses, so runs with different process counts can be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    parser.add_argument("--sequences", type=int, default=256, help="corpus size in sequences (default 256)")
    parser.add_argument("--plan", default="fsdp", help="fsdp | dp | zero1 | zero2 (default fsdp)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from openhosti_jax.mesh import initialize_distributed

    initialize_distributed(timeout_s=60)  # reads OPENHOSTI_* set by the launcher; a no-op in a single process

    import jax

    from openhosti_jax.demo.gpt_job import GPTJob, build_job
    from openhosti_jax.mesh import MeshConfig
    from openhosti_jax.train import Trainer

    print(f"process {jax.process_index()}/{jax.process_count()} pid {os.getpid()} devices {jax.device_count()}")
    job = GPTJob(
        steps=args.steps,
        global_batch=args.batch,
        num_sequences=args.sequences,
        plan=int(args.plan) if args.plan.isdigit() else args.plan,
        mesh=MeshConfig(data=1, fsdp=-1),
        progress=False,
        print_plan=False,
    )
    state, _, step, data = build_job(job)

    def paced_step(s, b):
        out = step(s, b)
        print(f"step {int(out[0].step)} loss {float(out[1]['loss']):.6f}", flush=True)
        time.sleep(args.step_sleep)
        return out

    paced_step.plan = step.plan
    result = Trainer(paced_step, progress=False).fit(state, data, num_steps=job.steps)
    losses = [h["loss"] for h in result.history]
    times = [h["step_time_s"] for h in result.history]
    print("RESULT " + json.dumps({"process": jax.process_index(), "losses": losses, "step_times": times}), flush=True)
    return 130 if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
