"""Load balancing benchmark: one of 4 devices (or one of 2 processes) slowed 2x / 4x by real extra work.

Variants, timed alternately in one process, medians of ``REPS``:
  static   : even split of M microbatches, throttled device(s)
  balanced : `Balancer` (probe every 10 steps) after it converged from measured times, same throttle
  ideal    : no throttle, every device given exactly the work-proportional share of work units
             (M / sum(speeds) microbatches each): the time perfect balancing would reach on this machine
  plain    : jit + lax.scan accumulation over the data-sharded batch, no throttle (for the overhead)
M is chosen so that the ideal share is an integer (2x: 28, 4x: 26 for devices; 24 / 20 for processes).

The 4 (or 2x2) simulated CPU devices share 2 real cores, so a throttled device's extra work also takes core time
from the others: the wall-clock ratios here are lower than on independent accelerators. The ``*_isolated`` keys
measure each device's local phase alone (the others given nothing) and take the max over devices: the critical
path the same assignments would have on hardware where devices do not share cores.
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

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WIDTH, ROWS, LAYERS, REPS = 256, 128, 4, 21


def loss_fn(p, mb, rng):
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


def slowdown_case(mesh, factor, m, throttle):
    import jax

    from openhosti_jax.balance import Balancer, make_balanced_grad_fn, place_microbatches

    size = mesh.shape["data"]
    params, mbs = data(m)
    rng = jax.random.key(0)
    bal = Balancer(loss_fn, mesh, total=m, every=10, throttle=throttle)
    counts = converge(bal, params, mbs, rng)
    cap = bal.step_fn.capacity
    throttled = bal.step_fn
    free = make_balanced_grad_fn(loss_fn, mesh, capacity=cap)
    even = bal.rebalancer.even()
    share = int(round(m / sum(1.0 / f for f in throttle.factors)))
    ideal_mbs = data(share * size)[1]
    buf_even = place_microbatches(mbs, even, cap, mesh)
    buf_ideal = place_microbatches(ideal_mbs, (share,) * size, max(cap, share), mesh)
    free_ideal = make_balanced_grad_fn(loss_fn, mesh, capacity=max(cap, share))
    t = alternate(
        {
            "static": lambda: throttled(params, place_microbatches(mbs, even, cap, mesh), even, rng),
            "balanced": lambda: bal(params, mbs, rng),
            "ideal": lambda: free_ideal(
                params, place_microbatches(ideal_mbs, (share,) * size, max(cap, share), mesh), (share,) * size, rng
            ),
        }
    )
    out = {
        f"static_over_balanced_{factor}x": t["static"] / t["balanced"],
        f"balanced_over_ideal_{factor}x": t["balanced"] / t["ideal"],
        f"balanced_counts_{factor}x": list(bal.counts),
        f"converged_counts_{factor}x": list(counts),
        f"seconds_{factor}x": t,
    }
    if jax.process_count() == 1:
        iso = {
            "static": isolated(throttled, params, buf_even, even, rng),
            "balanced": isolated(throttled, params, place_microbatches(mbs, bal.counts, cap, mesh), bal.counts, rng),
            "ideal": isolated(free_ideal, params, buf_ideal, (share,) * size, rng),
        }
        out[f"static_over_balanced_{factor}x_isolated"] = iso["static"] / iso["balanced"]
        out[f"balanced_over_ideal_{factor}x_isolated"] = iso["balanced"] / iso["ideal"]
    del free
    return out


def isolated(step, params, buffer, counts, rng):
    """max over devices of the median local-phase time with only that device given its microbatches."""
    worst = 0.0
    for i in range(len(counts)):
        only = tuple(c if j == i else 0 for j, c in enumerate(counts))
        samples = [step.probe(params, buffer, only, rng)[1][i] for _ in range(9)]
        worst = max(worst, float(np.median(samples)))
    return worst


def overhead_case(mesh, m):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from openhosti_jax.balance import Balancer

    size = mesh.shape["data"]
    params, mbs = data(m)
    rng = jax.random.key(0)
    bal = Balancer(loss_fn, mesh, total=m, every=10)
    k = m // size
    sharding = NamedSharding(mesh, PartitionSpec(None, "data"))

    @jax.jit
    def plain(p, x):
        def total(p):
            body = lambda acc, xb: (acc + loss_fn(p, {"x": xb}, None)[0], None)
            return jax.lax.scan(body, jnp.float32(0), x)[0]

        loss, g = jax.value_and_grad(total)(p)
        n = x.shape[0] * x.shape[1]
        return loss / n, jax.tree_util.tree_map(lambda a: a / n, g)

    def plain_step():
        # device i gets microbatches i*k .. i*k+k-1, as the balanced step's even split
        x = mbs["x"].reshape(size, k, ROWS, WIDTH).transpose(1, 0, 2, 3).reshape(k, size * ROWS, WIDTH)
        return plain(params, jax.device_put(x, sharding))

    t = alternate({"plain": plain_step, "balanced": lambda: bal(params, mbs, rng)})
    return {"overhead_no_slowdown": t["balanced"] / t["plain"] - 1.0, "seconds_no_slowdown": t}


def device_benchmark():
    import jax
    from jax.sharding import AxisType

    from openhosti_jax.balance import Throttle

    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    out = {}
    for factor, m in ((2, 28), (4, 26)):
        out.update(slowdown_case(mesh, factor, m, Throttle.for_devices(4, {3: factor})))
    out.update(overhead_case(mesh, 28))
    return out


def process_worker(pid, port):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    from jax.sharding import AxisType

    from openhosti_jax.balance import Throttle

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    out = {}
    for factor, m in ((2, 24), (4, 20)):
        res = slowdown_case(mesh, factor, m, Throttle.for_processes(mesh, "data", {1: factor}))
        out.update({f"process_{k}": v for k, v in res.items()})
    if pid == 0:
        print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def process_benchmark(timeout_s=150):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
    procs = [subprocess.Popen([*cmd, str(i), str(port)], env=env, stdout=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
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
        "4 simulated devices share 2 CPU cores: wall-clock ratios include core contention (a throttled device's "
        "extra work slows the others too); *_isolated keys time each device alone (independent-hardware "
        "critical path)"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        process_worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
