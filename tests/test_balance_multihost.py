"""Processes on 127.0.0.1 reading host-local data: the slowed process reads and runs fewer samples, every sample
of the epoch is run exactly once over the processes, and the balanced epoch beats the same epoch unbalanced.

Four devices in all (2 processes x 2, or 4 x 1) share the machine's 2 cores. A scaled sleep inside the loop (a
`Throttle` stall) makes every microbatch take 5x its measured CPU time, 10x on the slowed process: 2x slower.

Run as a script, this file is one worker: ``python test_balance_multihost.py PROCESS_ID PORT NUM_PROCESSES``.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

MICROBATCHES, ROWS, WIDTH, STEPS = 16, 32, 512, 6


def heavy_loss(p, mb, rng):
    import jax.numpy as jnp

    h = mb["x"]
    for _ in range(4):
        h = jnp.tanh(h @ p["w"])
    return jnp.sum(h**2), jnp.float32(mb["x"].shape[0])


def worker(process_id: int, port: int, num_processes: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id, initialization_timeout=60)
    import jax.numpy as jnp

    from openhosti_jax.balance import Balancer, HostLocalData, Monitor, Throttle

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    size, batch = jax.device_count(), MICROBATCHES * ROWS
    r = np.random.default_rng(0)
    n = STEPS * batch
    samples = {"x": r.normal(size=(n, WIDTH)).astype(np.float32), "id": np.arange(n, dtype=np.int32)}
    params = {"w": jnp.asarray(r.normal(size=(WIDTH, WIDTH)), jnp.float32) * 0.05}
    rng = jax.random.key(0)
    even = tuple(MICROBATCHES // size + (i < MICROBATCHES % size) for i in range(size))

    # the unthrottled seconds per microbatch, agreed by every process: process 1 then stalls as long again
    free = Balancer(heavy_loss, mesh, total=MICROBATCHES).step_fn
    monitor = Monitor(size, window=5)
    data = HostLocalData(samples, batch, microbatches=MICROBATCHES, seed=1)  # for measuring and converging
    probe_batch = next(data).place(even, max(even), mesh)
    for _ in range(5):
        monitor.observe(free.probe(params, probe_batch, even, rng)[1], even)
    # every device's microbatch takes 5x its CPU time (the rest a stall standing for accelerator time, so the
    # processes sharing 2 cores do not queue behind each other), process 1's 10x: exactly 2x slower
    factors = {p: 10 if p == 1 else 5 for p in range(num_processes)}
    slow = Throttle.for_processes(mesh, "data", factors, float(np.median(monitor.seconds_per_microbatch)))
    bal = Balancer(heavy_loss, mesh, total=MICROBATCHES, every=1, throttle=slow)

    def epoch(run) -> tuple[float, list[int]]:
        data = HostLocalData(samples, batch, microbatches=MICROBATCHES, seed=7, num_epochs=1, record_ids=True)
        jax.block_until_ready(run(next(data)))  # warm-up (compiles), not timed, not counted
        data.set_state({"epoch": 0, "position": 0, "seed": 7, "global_batch_size": batch})
        first, t0 = len(data.ids_read), time.perf_counter()
        for b in data:
            jax.block_until_ready(run(b))
        return time.perf_counter() - t0, data.ids_read[first:]

    static = lambda b: bal.step_fn(params, b.place(even, max(even), mesh), even, rng)
    t_static, _ = epoch(static)
    for _ in range(4):  # converge, then probe every 10 steps as in training
        bal.run(params, next(data).place(bal.counts, bal.buffer_slots(), mesh), rng)
    bal.monitor.every = 10
    t_balanced, ids = epoch(lambda b: bal.run(params, b.place(bal.counts, bal.buffer_slots(), mesh), rng))
    out = {"static_s": t_static, "balanced_s": t_balanced, "counts": list(bal.counts), "ids": ids}
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("num_processes", [2, 4])
def test_a_slowed_process_reads_fewer_samples_and_balancing_beats_the_unbalanced_run(num_processes):
    port, root = free_port(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={4 // num_processes}",  # 4 devices on the 2 cores
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [sys.executable, os.path.abspath(__file__)]
    procs = [
        subprocess.Popen(
            [*cmd, str(i), str(port), str(num_processes)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num_processes)
    ]
    try:
        outs = [p.communicate(timeout=360)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][len("RESULT ") :]))
    ids = [r["ids"] for r in results]
    everything = sorted(i for part in ids for i in part)
    assert everything == list(range(STEPS * MICROBATCHES * ROWS))  # each sample of the epoch exactly once
    assert len(ids[1]) < min(len(part) for k, part in enumerate(ids) if k != 1), [len(x) for x in ids]
    assert all(r["counts"] == results[0]["counts"] for r in results)
    speedup = results[0]["static_s"] / results[0]["balanced_s"]
    assert speedup > 1.15, results[0]  # 2x slowed process: even split ~1.5x (2 processes) the balanced time


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
