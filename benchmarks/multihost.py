"""Multi-process cost on one machine: 2 processes x 4 CPU devices vs 1 process x 8, and cross-process all-reduce.

    python benchmarks/multihost.py

Every run goes through `launch_local` (127.0.0.1, gloo collectives).

* Step time: `examples/multihost_worker.py` trains the demo GPT with FSDP over 8 devices, once as 1 process x 8
  devices and once as 2 processes x 4; the median step time after the compile steps is compared.
* All-reduce: 2 processes x 1 device, so every byte crosses the process boundary. In each of ROUNDS alternating
  rounds the planner's cost model (`openhosti_jax.planner.calibrate.calibrate`) is calibrated in this 2-process
  setting as the planner calibrates for a model whose gradient is TOP bytes (`calibration_sizes(TOP)`: 64 KiB
  .. 8 MiB, then sqrt(2) steps to 32 MiB; alternated, medians); its predictions for all-reduces of OFF_LADDER
  sizes (3, 12 and 24 MiB, none a calibration point, so they test the interpolation) are compared with medians
  measured right after, alternated (each a program of its own, so predicted = the profile's launch + the
  all-reduce). Per size the ratio is the median over rounds; the headline is the size farthest from 1.
  A detail: the default calibration (up to 8 MiB) extrapolating to 32 MiB, what the model does beyond its data.

The last line printed is one JSON object with the keys of benchmarks/README.md (multihost.py) and details.
``--quick`` (passed on to the all-reduce workers): 6 training steps of batch 8 (2 of them compile and warm-up),
1 round of 3 repetitions for the all-reduce comparison (without the detail of the default ladder extrapolating to
32 MiB, printed null); the same all-reduce sizes and code paths.
"""

from __future__ import annotations

import io
import json
import os
import sys

import goals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MIB = 2**20
TOP = 32 * MIB  # the gradient bytes the calibration is sized for
OFF_LADDER = (3 * MIB, 12 * MIB, 24 * MIB)  # measured all-reduce sizes, between calibration points
STEPS, WARMUP = (6, 2) if goals.QUICK else (14, 4)
BATCH = ["--batch", "8", "--sequences", "64"] if goals.QUICK else []  # the worker's defaults: 16 of 256
ROUNDS = 1 if goals.QUICK else 3  # calibrate / measure rounds of the all-reduce comparison
REPS = 3 if goals.QUICK else 7  # alternated repetitions per calibration and measurement
TIMEOUT_S = 150 if goals.QUICK else 200  # per launch_local run


def allreduce_worker() -> None:
    """One of 2 processes: in ROUNDS alternating rounds, calibrate the cost model across the two processes, then
    time all-reduces of the OFF_LADDER sizes across them."""
    from openhosti_jax.mesh import initialize_distributed

    initialize_distributed(timeout_s=60)
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from openhosti_jax.planner.calibrate import alternated_medians, calibrate, calibration_sizes

    ladder = calibration_sizes(TOP)
    assert not set(OFF_LADDER) & set(ladder) and max(OFF_LADDER) < ladder[-1], (OFF_LADDER, ladder)
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object), ("d",), axis_types=(AxisType.Explicit,))

    def array(nbytes):
        sharding = NamedSharding(mesh, P("d"))
        return jax.make_array_from_process_local_data(sharding, np.ones((1, nbytes // 4), np.float32), (n, nbytes // 4))

    f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    xs, tiny, top = [array(b) for b in OFF_LADDER], array(4), array(TOP)
    rounds = []
    for _ in range(ROUNDS):
        profile = calibrate(devices, reps=REPS, sizes=ladder)
        # the default ladder, up to 8 MiB: extrapolates to TOP (a detail; quick mode skips it)
        short = None if goals.QUICK else calibrate(devices, reps=REPS)
        measured = alternated_medians([*(lambda x=x: f(x) for x in xs), lambda: f(top)], REPS, lambda: f(tiny))
        rounds.append(
            {
                "measured_s": measured[:-1],
                # each measured all-reduce is a program of its own: one launch + the collective
                "predicted_s": [
                    profile.launch_seconds + profile.collective_seconds("all_reduce", b, n) for b in OFF_LADDER
                ],
                "top_extrapolated_over_measured": None
                if short is None
                else (short.launch_seconds + short.collective_seconds("all_reduce", TOP, n)) / measured[-1],
                "curve": profile.link_curve["all_reduce"][n],
            }
        )
    total = float(f(xs[0]).addressable_data(0)[0, 0])
    out = {"process": jax.process_index(), "devices": n, "rounds": rounds, "psum_value": total}
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def _run(cmd: list[str], n: int, devices: int) -> dict[int, dict]:
    from openhosti_jax.mesh.launch import launch_local

    log = io.StringIO()
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc = launch_local(cmd, n, local_devices=devices, env=env, timeout_s=TIMEOUT_S, kill_grace_s=3, output=log)
    if rc:
        raise SystemExit(f"{cmd} on {n} processes failed with {rc}:\n{log.getvalue()[-3000:]}")
    out = {}
    for line in log.getvalue().splitlines():
        if "RESULT " in line:
            r = json.loads(line.split("RESULT ", 1)[1])
            out[r["process"]] = r
    return out


def main() -> None:
    import numpy as np

    worker = [sys.executable, os.path.join(ROOT, "examples", "multihost_worker.py"), "--steps", str(STEPS), *BATCH]
    one = _run(worker, 1, 8)[0]
    two = _run(worker, 2, 4)
    one_s = float(np.median(one["step_times"][WARMUP:]))
    two_s = float(np.median([np.median(r["step_times"][WARMUP:]) for r in two.values()]))
    losses_match = max(abs(a - b) for a, b in zip(one["losses"], two[0]["losses"], strict=True))
    quick = ["--quick"] if goals.QUICK else []
    ar = _run([sys.executable, os.path.abspath(__file__), "--allreduce", *quick], 2, 1)[0]
    assert ar["psum_value"] == 2.0, ar
    rounds = ar["rounds"]
    per_size = {
        f"{b // MIB}MiB": float(np.median([r["measured_s"][i] / r["predicted_s"][i] for r in rounds]))
        for i, b in enumerate(OFF_LADDER)
    }
    worst = max(per_size.values(), key=lambda r: abs(np.log(r)))
    ms = lambda seconds: {k: round(t * 1e3, 3) for k, t in zip(per_size, seconds, strict=True)}
    last = rounds[-1]
    result = {
        "allreduce_measured_over_predicted": worst,
        "two_process_over_one_process": two_s / one_s,
        "one_process_step_s": one_s,
        "two_process_step_s": two_s,
        "max_loss_diff_two_vs_one": losses_match,
        "allreduce_measured_over_predicted_by_size": per_size,
        "allreduce_measured_ms_last_round": ms(last["measured_s"]),
        "allreduce_predicted_ms_last_round": ms(last["predicted_s"]),
        "calibrated_curve_last_round": [(int(b), round(t * 1e3, 3)) for b, t in last["curve"]],
        "allreduce_32MiB_measured_over_predicted_calibrated_to_8MiB": None
        if goals.QUICK
        else float(np.median([1 / r["top_extrapolated_over_measured"] for r in rounds])),
        "steps_measured": STEPS - WARMUP,
    }
    goals.emit(result, __file__)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--allreduce"]:
        allreduce_worker()  # a child of launch_local, which set its devices
    else:
        # 8 CPU devices before jax loads (the children get theirs from launch_local).
        flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        main()
