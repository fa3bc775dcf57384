"""Two processes on 127.0.0.1 (2 CPU devices each, gloo): work moves off the throttled process.

Run as a script, this file is one worker: ``python test_balance_multiprocess.py PROCESS_ID PORT``.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

TOTAL, WIDTH, ROWS = 16, 256, 64


def heavy_loss(p, mb, rng):
    import jax.numpy as jnp

    h = mb["x"]
    for _ in range(4):
        h = jnp.tanh(h @ p["w"])
    return jnp.sum(h**2), jnp.float32(mb["x"].shape[0])


def worker(process_id: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60
    )
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from openhosti_jax.balance import Balancer, Throttle
    from openhosti_jax.balance.throttle import data_axis_processes

    mesh = jax.make_mesh((4,), ("data",))
    r = np.random.default_rng(0)  # the same data on both processes
    params = {"w": jnp.asarray(r.normal(size=(WIDTH, WIDTH)), jnp.float32) * 0.05}
    mbs = {"x": r.normal(size=(TOTAL, ROWS, WIDTH)).astype(np.float32)}
    throttle = Throttle.for_processes(mesh, "data", {1: 6})
    bal = Balancer(heavy_loss, mesh, total=TOTAL, every=1, alpha=1.0, throttle=throttle)
    for _ in range(5):
        loss, grads, n = bal(params, mbs, jax.random.key(0))
    multihost_utils.assert_equal(np.asarray(bal.counts), "counts differ across processes")
    ref = jax.grad(lambda p: sum(heavy_loss(p, {"x": mbs["x"][k]}, None)[0] for k in range(TOTAL)))(params)
    got = np.asarray(grads["w"].addressable_data(0))
    err = float(np.abs(got - np.asarray(ref["w"]) / (TOTAL * ROWS)).max())
    owners = data_axis_processes(mesh, "data")
    print(
        "RESULT "
        + json.dumps(
            {
                "counts": list(bal.counts),
                "owners": list(owners),
                "host_seconds": {str(k): v for k, v in bal.monitor.host_seconds(owners).items()},
                "grad_err": err,
                "n_real": float(n.addressable_data(0)),
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_shift_work_away_from_the_throttled_one():
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(i), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=200)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT ") :]))
    a, b = results
    assert a["counts"] == b["counts"]  # every process computed the same assignment
    counts, owners = np.asarray(a["counts"]), np.asarray(a["owners"])
    assert sorted(set(owners.tolist())) == [0, 1]
    assert counts.sum() == TOTAL and counts[owners == 0].min() >= 1  # a throttled device may drop to zero work
    assert counts[owners == 1].sum() < counts[owners == 0].sum(), a
    assert a["host_seconds"]["1"] > 0 and a["host_seconds"]["0"] > 0
    for res in results:
        assert res["n_real"] == TOTAL * ROWS
        assert res["grad_err"] < 1e-6


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]))
