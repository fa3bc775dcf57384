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

FSDP (``fsdp_*`` keys): the same static / balanced / ideal on an fsdp=8 mesh (8 devices, parameters sharded over
fsdp, gathered once per step, gradient reduce-scattered), device 7 2x slow (M = 60, ideal share 8); every
microbatch takes BASE x its CPU time (the rest a stall standing for accelerator time), BASE x 2 on device 7.
``fsdp_gather_microbatch_*``: the same with the ZeRO-3 memory mode (parameters gathered in every iteration of a
masked loop; the iterations synchronise the devices, so the balancer idles the straggler rather than sharing).
Host-local data (``host_bytes_read_over_share``, ``multihost_static_over_balanced``): 2 processes x 2 devices
read a `HostLocalData` source by index, process 1 2x slow (BASE as above); epochs unbalanced (even split) and
balanced in turn, and the bytes each process read over the bytes of the samples its devices ran (1: only its share).

Prints one JSON object on its last line (keys and goals in benchmarks/README.md). ``--quick`` (passed on to the
workers): width 128, 64 rows, 5 reps, the 2x factor only (M = 14 for devices, 12 for processes), both kinds on
the devices and the stall kind across the processes; the same code paths.
"""

import os
import sys

if "--worker" not in sys.argv and "--hostlocal-worker" not in sys.argv:  # workers get 2 devices each
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
FSDP_M = 60  # 8 devices, one 2x: ideal share M / 7.5 = 8 (the even split gives the slow device 7)
FSDP_REPS = 5 if goals.QUICK else 9  # its steps last seconds (8 devices' stalls at BASE x the contended CPU time)
BASE = 5  # fsdp and host-local cases: a microbatch takes BASE x its CPU time, 2 x BASE on the slowed device
HOSTLOCAL_STEPS = 4 if goals.QUICK else 6  # steps per timed epoch (2 processes, 24 microbatches a step)
HOSTLOCAL_REPS = 3 if goals.QUICK else 5  # epochs per variant, alternated; the median is reported
HOSTLOCAL_SHAPE = (256, 32) if goals.QUICK else (512, 32)  # width, rows per microbatch
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


def alternate(variants: dict, reps: int = REPS) -> dict:
    """Median seconds per variant, the order rotated each round."""
    names = list(variants)
    for f in variants.values():  # warm-up / compile
        timed(f)
    times = {n: [] for n in names}
    for r in range(reps):
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


def microbatch_seconds(step, params, mbs, counts, rng, probes=5, axis="data"):
    """Median measured seconds per microbatch of an unthrottled step (agreed by every process)."""
    from openhosti_jax.balance import Monitor, place_microbatches

    monitor = Monitor(step.size, window=probes)
    buffer = place_microbatches(mbs, counts, max(counts), step.mesh, axis)
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


def fsdp_case(m, gather="step", prefix="fsdp_"):
    """Static / balanced / ideal on fsdp=8 with device 7 stalling 2x (parameters sharded; gathered once per step,
    or with ``gather="microbatch"`` in every iteration of the masked loop)."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from openhosti_jax.balance import Balancer, Throttle, make_balanced_grad_fn, place_microbatches

    mesh = jax.make_mesh((1, 8), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    axis, size = ("data", "fsdp"), 8
    shards = {"w": NamedSharding(mesh, PartitionSpec("fsdp"))}
    params, mbs = data(m)
    params = jax.device_put(params, shards)
    rng = jax.random.key(0)
    even = tuple(m // size + (i < m % size) for i in range(size))
    kw = dict(axis=axis, grad_shardings=shards, gather=gather)
    free = make_balanced_grad_fn(loss_sum_fn, mesh, capacity=m, **kw)
    cpu = microbatch_seconds(free, params, mbs, even, rng, axis=axis)
    # a microbatch takes BASE x its CPU time on every device (the rest a stall: simulated accelerator time, so the 8
    # devices sharing 2 cores do not queue behind each other), 2 x BASE on device 7: exactly 2x slower
    throttle = Throttle.for_devices(size, {i: BASE * (2 if i == 7 else 1) for i in range(size)}, cpu)
    bal = Balancer(loss_sum_fn, mesh, total=m, every=10, throttle=throttle, **kw)
    unslowed = make_balanced_grad_fn(
        loss_sum_fn, mesh, capacity=m, throttle=Throttle.for_devices(size, dict.fromkeys(range(size), BASE), cpu), **kw
    )
    with jax.set_mesh(mesh):
        counts = converge(bal, params, mbs, rng)
        share = int(round(m * BASE / sum(BASE / f for f in throttle.factors) / BASE))
        ideal_mbs = data(share * size)[1]
        slots = max(even)
        t = alternate(
            {
                "static": lambda: bal.step_fn(params, place_microbatches(mbs, even, slots, mesh, axis), even, rng),
                "balanced": lambda: bal(params, mbs, rng),
                "ideal": lambda: unslowed(
                    params, place_microbatches(ideal_mbs, (share,) * size, share, mesh, axis), (share,) * size, rng
                ),
            },
            reps=FSDP_REPS,
        )
    return {
        f"{prefix}static_over_balanced_2x_straggler": t["static"] / t["balanced"],
        f"{prefix}balanced_over_ideal": t["balanced"] / t["ideal"],
        f"{prefix}balanced_counts": list(bal.counts),
        f"{prefix}converged_counts": list(counts),
        f"{prefix}seconds": t,
        f"{prefix}cpu_per_microbatch_ms": cpu * 1e3,
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
    out.update(fsdp_case(FSDP_M))
    out.update(fsdp_case(FSDP_M, gather="microbatch", prefix="fsdp_gather_microbatch_"))
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


def hostlocal_worker(pid, port):
    """One of 2 processes: epochs of host-local data unbalanced and balanced in turn, process 1 stalling 2x."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType

    from openhosti_jax.balance import Balancer, HostLocalData, Throttle, make_balanced_grad_fn
    from openhosti_jax.balance.throttle import data_axis_processes

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    m, size, width, rows = 24, 4, *HOSTLOCAL_SHAPE  # ideal: 8 microbatches on each fast device, 4 on each slow
    r = np.random.default_rng(1)
    params = {"w": jnp.asarray(r.normal(size=(width, width)), jnp.float32) * 0.05}
    samples = {"x": r.normal(size=(HOSTLOCAL_STEPS * m * rows, width)).astype(np.float32)}
    rng, even = jax.random.key(0), (m // size,) * size
    probe = {"x": samples["x"][: m * rows].reshape(m, rows, width)}
    mb_s = microbatch_seconds(make_balanced_grad_fn(loss_sum_fn, mesh, capacity=m), params, probe, even, rng)
    slowed = Throttle.for_processes(mesh, "data", {0: BASE, 1: 2 * BASE}, mb_s)  # see fsdp_case: process 1 is 2x
    bal = Balancer(loss_sum_fn, mesh, total=m, every=10, throttle=slowed)
    mine = np.asarray(data_axis_processes(mesh, "data")) == pid
    gbs = m * rows

    def epoch(counts_of, run):
        """Seconds of one epoch and the bytes read over the bytes of the samples this process's devices ran."""
        src = HostLocalData(samples, gbs, microbatches=m, seed=3)
        share, t0 = 0, time.perf_counter()
        for _ in range(HOSTLOCAL_STEPS):
            share += int(np.asarray(counts_of())[mine].sum()) * rows * width * 4
            jax.block_until_ready(run(next(src)))
        return time.perf_counter() - t0, src.bytes_read / share

    static = (lambda: even, lambda b: bal.step_fn(params, b.place(even, max(even), mesh), even, rng))
    balanced = (lambda: bal.counts, lambda b: bal.run(params, b.place(bal.counts, bal.buffer_slots(), mesh), rng))
    bal.monitor.every = 1
    epoch(*static)  # compile
    epoch(*balanced)  # converge, probing every step
    bal.monitor.every = 10  # then probe every 10 steps as in training
    times, reads = {"static": [], "balanced": []}, []
    for _ in range(HOSTLOCAL_REPS):
        for name, variant in (("static", static), ("balanced", balanced)):
            seconds, read = epoch(*variant)
            times[name].append(seconds)
            reads.append(read)
    reads = np.asarray(multihost_utils.process_allgather(np.asarray(reads)))
    if pid == 0:
        t = {k: float(np.median(v)) for k, v in times.items()}
        out = {
            "multihost_static_over_balanced": t["static"] / t["balanced"],
            "host_bytes_read_over_share": float(reads.max()),
            "multihost_counts": list(bal.counts),
            "multihost_epoch_seconds": t,
            "multihost_cpu_per_microbatch_ms": mb_s * 1e3,
        }
        print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def process_benchmark(timeout_s=PROCESS_TIMEOUT_S, mode="--worker"):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.abspath(__file__), mode]
    error = "process_error" if mode == "--worker" else "hostlocal_error"
    quick = ["--quick"] if goals.QUICK else []
    procs = [
        subprocess.Popen([*cmd, str(i), str(port), *quick], env=env, stdout=subprocess.PIPE, text=True) for i in (0, 1)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:
        return {error: f"workers ran past {timeout_s} s"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [x for x in outs[0].splitlines() if x.startswith("RESULT ")]
    if not lines or any(p.returncode for p in procs):
        return {error: f"workers exited {[p.returncode for p in procs]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def main():
    t0 = time.perf_counter()
    out = device_benchmark()
    out.update(process_benchmark())
    out.update(process_benchmark(mode="--hostlocal-worker"))
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
    elif len(sys.argv) > 1 and sys.argv[1] == "--hostlocal-worker":
        hostlocal_worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
