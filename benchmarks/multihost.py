"""Multi-process cost on one machine: 2 processes x 4 CPU devices vs 1 process x 8, and cross-process all-reduce.

    python benchmarks/multihost.py

Every run goes through `launch_local` (127.0.0.1, gloo collectives).

* Step time: `examples/multihost_worker.py` trains the demo GPT with FSDP over 8 devices, once as 1 process x 8
  devices and once as 2 processes x 4; the median step time after the compile steps is compared.
* All-reduce: 2 processes x 1 device, so every byte crosses the process boundary. In each of ROUNDS alternating
  rounds the planner's cost model (`openhosti_jax.planner.profile.calibrate`) fits its alpha-beta all-reduce
  model in this 2-process setting from timings at 64 KiB .. 8 MiB (alternated, medians, least squares); its
  prediction for a 32 MiB all-reduce (4x past the largest calibration size, never a calibration point) is
  compared with a median measured right after. The ratio reported is the median over rounds. A 16 MiB
  all-reduce, timed alternated with it, gives the same ratio at 2x past the calibration sizes (a detail).

The last line printed is one JSON object with the keys of BENCHMARKS.md (multihost.py) and details.
"""

from __future__ import annotations

import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BIG = 2**25  # bytes of the measured all-reduce
MID = 2**24  # a second, nearer size, measured alternated with BIG (a detail)
STEPS, WARMUP = 14, 4
ROUNDS = 3  # calibrate / measure rounds of the all-reduce comparison


def allreduce_worker() -> None:
    """One of 2 processes: in ROUNDS alternating rounds, calibrate the cost model across the two processes, then
    time a BIG-byte all-reduce across them (never a calibration size)."""
    from openhosti_jax.mesh import initialize_distributed

    initialize_distributed(timeout_s=60)
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from openhosti_jax.planner.profile import CALIBRATION_SIZES, _alternated_medians, calibrate

    assert BIG > 2 * max(CALIBRATION_SIZES), "the measured size must lie beyond the calibration sizes"
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object), ("d",), axis_types=(AxisType.Explicit,))
    x, x_mid, tiny = (
        jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("d")), np.ones((1, b // 4), np.float32), (n, b // 4)
        )
        for b in (BIG, MID, 4)
    )
    f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    rounds = []
    for _ in range(ROUNDS):
        profile = calibrate(devices, reps=7)
        measured, measured_mid = _alternated_medians([lambda: f(x), lambda: f(x_mid)], 7, lambda: f(tiny))
        rounds.append(
            {
                "measured_s": measured,
                "predicted_s": profile.collective_seconds("all_reduce", BIG, n),
                "mid_over_predicted": measured_mid / profile.collective_seconds("all_reduce", MID, n),
                "alpha_s": profile.link_latency,
                "bus_bandwidth_Bps": profile.link_bandwidth["all_reduce"],
            }
        )
    total = float(f(x).addressable_data(0)[0, 0])
    out = {"process": jax.process_index(), "devices": n, "bytes": BIG, "rounds": rounds, "psum_value": total}
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def _run(cmd: list[str], n: int, devices: int) -> dict[int, dict]:
    from openhosti_jax.mesh.launch import launch_local

    log = io.StringIO()
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc = launch_local(cmd, n, local_devices=devices, env=env, timeout_s=200, kill_grace_s=3, output=log)
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

    worker = [sys.executable, os.path.join(ROOT, "examples", "multihost_worker.py"), "--steps", str(STEPS)]
    one = _run(worker, 1, 8)[0]
    two = _run(worker, 2, 4)
    one_s = float(np.median(one["step_times"][WARMUP:]))
    two_s = float(np.median([np.median(r["step_times"][WARMUP:]) for r in two.values()]))
    losses_match = max(abs(a - b) for a, b in zip(one["losses"], two[0]["losses"], strict=True))
    ar = _run([sys.executable, os.path.abspath(__file__), "--allreduce"], 2, 1)[0]
    assert ar["psum_value"] == 2.0, ar
    rounds = ar["rounds"]
    ratios = [r["measured_s"] / r["predicted_s"] for r in rounds]
    mid = rounds[int(np.argsort(ratios)[len(ratios) // 2])]
    result = {
        "allreduce_measured_over_predicted": float(np.median(ratios)),
        "two_process_over_one_process": two_s / one_s,
        "one_process_step_s": one_s,
        "two_process_step_s": two_s,
        "max_loss_diff_two_vs_one": losses_match,
        "allreduce_bytes": ar["bytes"],
        "allreduce_measured_over_predicted_per_round": ratios,
        "allreduce_16MiB_measured_over_predicted": float(np.median([r["mid_over_predicted"] for r in rounds])),
        "allreduce_measured_s": mid["measured_s"],
        "allreduce_predicted_s": mid["predicted_s"],
        "allreduce_measured_bus_GBps": 2 * (ar["devices"] - 1) / ar["devices"] * ar["bytes"] / mid["measured_s"] / 1e9,
        "calibrated_alpha_s": mid["alpha_s"],
        "calibrated_bus_GBps": mid["bus_bandwidth_Bps"] / 1e9,
        "steps_measured": STEPS - WARMUP,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:] == ["--allreduce"]:
        allreduce_worker()  # a child of launch_local, which set its devices
    else:
        # 8 CPU devices before jax loads (the children get theirs from launch_local).
        flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        main()
