"""Load balancing benchmark: one of 4 devices (or one of 2 processes) slowed 2x / 4x.

Two kinds of slowdown (`Throttle`), each measured:
  stall (the headline keys): the slow device blocks ``(factor - 1)`` x its measured microbatch time after each
        microbatch, leaving the cores to the others: a throttled accelerator, slower without slowing its peers.
  work  (``*_work`` keys): the slow device really computes ``factor`` x the FLOPs. The 4 (or 2x2) simulated CPU
        devices share 2 real cores, so its extra work takes core time from every device, like a competing
        process: balancing then saves only the work-time it moves off the slow device, and the ratios are lower.
Variants, timed alternately in one process, medians of ``REPS``:
  static   : even split of M microbatches, throttled device(s)
  balanced : `Balancer` (probe every 10 steps) after it converged from measured times, same throttle
  ideal    : no throttle, every device given exactly the work-proportional share of work units
             (M / sum(1 / factors) microbatches each): the time perfect balancing would reach on this machine
  plain    : the library's plain microbatched gradient (`accumulate_gradients` under jit, the step
             ``@spmd(microbatches=M)`` runs without ``balance=True``), no throttle (for the overhead)
M is chosen so that the ideal share is an integer (2x: 28, 4x: 26 for devices; 24 / 20 for processes).

Prints one JSON object on its last line (keys and goals in benchmarks/README.md). ``--quick`` (passed on to the
workers): width 128, 64 rows, 5 reps, the 2x factor only (M = 14 for devices, 12 for processes), both kinds on
the devices and the stall kind across the processes; the same code paths.
"""

import os
import sys

if "--worker" not in sys.argv:  # workers inherit 2 devices each from the parent
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import goals  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WIDTH, ROWS, LAYERS, REPS = (128, 64, 4, 5) if goals.QUICK else (256, 128, 4, 21)
# (factor, M) per case, M making the ideal share an integer; and the kinds across processes
DEVICE_CASES = ((2, 14),) if goals.QUICK else ((2, 28), (4, 26))
PROCESS_CASES = ((2, 12),) if goals.QUICK else ((2, 24), (4, 20))
PROCESS_KINDS = ("stall",) if goals.QUICK else ("stall", "work")
OVERHEAD_M = 14 if goals.QUICK else 28
PROCESS_TIMEOUT_S = 150 if goals.QUICK else 240


def loss_sum_fn(p, mb, rng):
    import jax.numpy as jnp

    h = mb["x"]
    for _ in range(LAYERS):
        h = jnp.tanh(h @ p["w"])
    return jnp.sum(h**2), jnp.float32(mb["x"].shape[0])


def data(m):
    import jax.numpy as jnp

    r = np.random.default_rng(0)
    params = {"w": jnp.asarray(r.normal(size=(WIDTH, WIDTH)), jnp.float32) * 0.05}
    return params, {"x": r.normal(size=(m, ROWS, WIDTH)).astype(np.float32)}


def timed(fn):
    import jax

    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def alternate(variants: dict) -> dict:
    """Median seconds per variant, the order rotated each round."""
    names = list(variants)
    for f in variants.values():  # warm-up / compile
        timed(f)
    times = {n: [] for n in names}
    for r in range(REPS):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times[n].append(timed(variants[n]))
    return {n: float(np.median(v)) for n, v in times.items()}


def converge(bal, params, mbs, rng, steps=8):
    """Let the Balancer probe every step until counts settle, then probe every 10 steps as in training."""
    every = bal.monitor.every
    bal.monitor.every = 1
    for _ in range(steps):
        bal(params, mbs, rng)
    bal.monitor.every = every
    return bal.counts


def microbatch_seconds(step, params, mbs, counts, rng, probes=5):
    """Median measured seconds per microbatch of an unthrottled step (agreed by every process)."""
    from openhosti_jax.balance import Monitor, place_microbatches

    monitor = Monitor(step.size, window=probes)
    buffer = place_microbatches(mbs, counts, step.capacity, step.mesh)
    for _ in range(probes):
        monitor.observe(step.probe(params, buffer, counts, rng)[1], counts)
    return float(np.median(monitor.seconds_per_microbatch))


def slowdown_case(mesh, factor, m, throttle_for, kind):
    """Static / balanced / ideal seconds with ``throttle_for(microbatch_seconds)`` slowing the chosen devices."""
    import jax

    from openhosti_jax.balance import Balancer, make_balanced_grad_fn, place_microbatches

    size = mesh.shape["data"]
    params, mbs = data(m)
    rng = jax.random.key(0)
    cap = min(m, 2 * -(-m // size))
    free = make_balanced_grad_fn(loss_sum_fn, mesh, capacity=cap)
    even = tuple(m // size + (i < m % size) for i in range(size))
    throttle = throttle_for(microbatch_seconds(free, params, mbs, even, rng))
    bal = Balancer(loss_sum_fn, mesh, total=m, every=10, throttle=throttle, capacity=cap)
    counts = converge(bal, params, mbs, rng)
    throttled = bal.step_fn
    share = int(round(m / sum(1.0 / f for f in throttle.factors)))
    ideal_mbs = data(share * size)[1]
    free_ideal = make_balanced_grad_fn(loss_sum_fn, mesh, capacity=max(cap, share))
    t = alternate(
        {
            "static": lambda: throttled(params, place_microbatches(mbs, even, cap, mesh), even, rng),
            "balanced": lambda: bal(params, mbs, rng),
            "ideal": lambda: free_ideal(
                params, place_microbatches(ideal_mbs, (share,) * size, max(cap, share), mesh), (share,) * size, rng
            ),
        }
    )
    sfx = f"{factor}x" + ("" if kind == "stall" else f"_{kind}")
    return {
        f"static_over_balanced_{sfx}": t["static"] / t["balanced"],
        f"balanced_over_ideal_{sfx}": t["balanced"] / t["ideal"],
        f"balanced_counts_{sfx}": list(bal.counts),
        f"converged_counts_{sfx}": list(counts),
        f"seconds_{sfx}": t,
        **({f"stall_per_microbatch_ms_{sfx}": throttle.microbatch_seconds * 1e3} if throttle.stalls else {}),
    }


def overhead_case(mesh, m):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from openhosti_jax.balance import Balancer
    from openhosti_jax.microbatch import accumulate_gradients

    size = mesh.shape["data"]
    params, mbs = data(m)
    rng = jax.random.key(0)
    bal = Balancer(loss_sum_fn, mesh, total=m, every=10)
    rows = NamedSharding(mesh, PartitionSpec("data"))
    # the same rows per device per microbatch as the balanced step's even split: m / size microbatches of
    # size * ROWS rows, each split over the devices
    plain = jax.jit(lambda p, b, r: accumulate_gradients(loss_sum_fn, p, b, m // size, r, microbatch_sharding=rows)[:2])
    flat = {"x": mbs["x"].reshape(m * ROWS, WIDTH)}

    def plain_step():
        return plain(params, jax.device_put(flat, rows), rng)

    t = alternate({"plain": plain_step, "balanced": lambda: bal(params, mbs, rng)})
    return {"overhead_no_slowdown": t["balanced"] / t["plain"] - 1.0, "seconds_no_slowdown": t}


def device_benchmark():
    import jax
    from jax.sharding import AxisType

    from openhosti_jax.balance import Throttle

    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    out = {}
    for kind in ("stall", "work"):
        for factor, m in DEVICE_CASES:
            throttle_for = lambda mb, f=factor, k=kind: Throttle.for_devices(4, {3: f}, mb if k == "stall" else None)
            out.update(slowdown_case(mesh, factor, m, throttle_for, kind))
    out.update(overhead_case(mesh, OVERHEAD_M))
    return out


def process_worker(pid, port):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    from jax.sharding import AxisType

    from openhosti_jax.balance import Throttle

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    out = {}
    for kind in PROCESS_KINDS:
        for factor, m in PROCESS_CASES:
            throttle_for = lambda mb, f=factor, k=kind: Throttle.for_processes(
                mesh, "data", {1: f}, mb if k == "stall" else None
            )
            res = slowdown_case(mesh, factor, m, throttle_for, kind)
            out.update({f"process_{k}": v for k, v in res.items()})
    if pid == 0:
        print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def process_benchmark(timeout_s=PROCESS_TIMEOUT_S):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
    quick = ["--quick"] if goals.QUICK else []
    procs = [
        subprocess.Popen([*cmd, str(i), str(port), *quick], env=env, stdout=subprocess.PIPE, text=True) for i in (0, 1)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:
        return {"process_error": f"workers ran past {timeout_s} s"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [x for x in outs[0].splitlines() if x.startswith("RESULT ")]
    if not lines or any(p.returncode for p in procs):
        return {"process_error": f"workers exited {[p.returncode for p in procs]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def main():
    t0 = time.perf_counter()
    out = device_benchmark()
    out.update(process_benchmark())
    out["benchmark_seconds"] = time.perf_counter() - t0
    out["note"] = (
        "headline keys: the slow device stalls (a throttled accelerator: slower, its peers unaffected); *_work "
        "keys: it computes factor x the FLOPs on the 2 CPU cores all 4 simulated devices share, so its extra "
        "work also slows the others (a competing process) and balancing can recover only part of it"
    )
    goals.emit(out, __file__)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        process_worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
