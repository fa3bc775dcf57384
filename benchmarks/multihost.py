"""Multi-process cost on one machine: 2 processes x 4 CPU devices vs 1 process x 8, and cross-process all-reduce.

    python benchmarks/multihost.py

Every run goes through `launch_local` (127.0.0.1, gloo collectives).

* Step time: `examples/multihost_worker.py` trains the demo GPT with FSDP over 8 devices, once as 1 process x 8
  devices and once as 2 processes x 4; the median step time after the compile steps is compared.
* All-reduce: 2 processes x 1 device, so every byte crosses the process boundary. The planner's cost model
  (`openhosti_jax.planner.profile.calibrate`) fits its alpha-beta all-reduce model from timings at 16 KiB and
  2 MiB on these devices; its prediction for a 32 MiB all-reduce is compared with a measured median at that size
  (an extrapolation of 16x past the largest calibration size). For comparison the same alpha-beta form is also
  fitted at 2 and 8 MiB (``allreduce_measured_over_predicted_fit_2_8MiB``).

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
STEPS, WARMUP = 14, 4


def allreduce_worker() -> None:
    """One of 2 processes: calibrate the cost model, then time a BIG-byte all-reduce across the processes."""
    from openhosti_jax.mesh import initialize_distributed

    initialize_distributed(timeout_s=60)
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from openhosti_jax.planner.profile import _fit_alpha_beta, _median_seconds, calibrate

    devices = jax.devices()
    n = len(devices)
    profile = calibrate(devices, reps=9)
    mesh = Mesh(np.asarray(devices, dtype=object), ("d",), axis_types=(AxisType.Explicit,))
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("d")), np.ones((1, BIG // 4), np.float32), (n, BIG // 4)
    )
    f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def timed(nbytes: int) -> float:
        local = np.ones((1, nbytes // 4), np.float32)
        y = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local, (n, nbytes // 4))
        return _median_seconds(lambda: f(y), 9)

    measured = timed(BIG)
    total = float(f(x).addressable_data(0)[0, 0])
    predicted = profile.collective_seconds("all_reduce", BIG, n)
    # The same alpha-beta form fitted at 2 and 8 MiB instead of the planner's 16 KiB and 2 MiB.
    sizes = (2**21, 2**23)
    alpha, bw = _fit_alpha_beta([s * (n - 1) / n for s in sizes], [timed(s) for s in sizes], 2.0)
    predicted_mid = alpha + 2.0 * (n - 1) / n * BIG / bw
    out = {
        "process": jax.process_index(),
        "devices": n,
        "bytes": BIG,
        "measured_s": measured,
        "predicted_s": predicted,
        "alpha_s": profile.link_latency,
        "bus_bandwidth_Bps": profile.link_bandwidth["all_reduce"],
        "psum_value": total,
        "predicted_mid_s": predicted_mid,
    }
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
    result = {
        "allreduce_measured_over_predicted": ar["measured_s"] / ar["predicted_s"],
        "two_process_over_one_process": two_s / one_s,
        "one_process_step_s": one_s,
        "two_process_step_s": two_s,
        "max_loss_diff_two_vs_one": losses_match,
        "allreduce_bytes": ar["bytes"],
        "allreduce_measured_s": ar["measured_s"],
        "allreduce_predicted_s": ar["predicted_s"],
        "allreduce_measured_bus_GBps": 2 * (ar["devices"] - 1) / ar["devices"] * ar["bytes"] / ar["measured_s"] / 1e9,
        "allreduce_measured_over_predicted_fit_2_8MiB": ar["measured_s"] / ar["predicted_mid_s"],
        "calibrated_alpha_s": ar["alpha_s"],
        "calibrated_bus_GBps": ar["bus_bandwidth_Bps"] / 1e9,
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
