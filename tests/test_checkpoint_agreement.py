"""Time- and signal-triggered saves are decided by all processes together: two processes whose clocks disagree on
when 15 ms have passed, and a SIGTERM sent to one process only, still save the same steps and stop together.

Run as a script (through `launch_local`), this file is one worker: ``python FILE DIR``."""

import json
import os
import signal
import sys
import time

import pytest

STEPS = 60


def worker(directory: str) -> dict:
    from openhosti_jax.mesh import initialize_distributed

    initialize_distributed(timeout_s=60)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from openhosti_jax.checkpoint import CheckpointManager

    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    x = jax.make_array_from_callback((jax.device_count() * 4,), sh, lambda idx: np.ones(4, np.float32))
    step = jax.jit(lambda a: a + jnp.sum(a) * 1e-6, out_shardings=sh)
    me = jax.process_index()
    saved, stopped_at = [], None
    with CheckpointManager(directory, every_minutes=0.00025, agree_every=5) as ckpt:
        ckpt.save_on_signal()
        for i in range(1, STEPS + 1):
            x = step(x)
            x.block_until_ready()
            time.sleep(0.004 if me == 0 else 0.011)  # the clocks disagree on when a save is due
            if i == 33 and me == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # only process 1 is told to stop
            if ckpt.maybe_save(i, {"x": x}):
                saved.append(i)
            if ckpt.preempted:
                stopped_at = i
                break
    return {"process": me, "saved": saved, "stopped_at": stopped_at}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_processes_agree_on_timed_and_signalled_saves(tmp_path):
    import io

    from openhosti_jax.mesh.launch import launch_local

    out = io.StringIO()
    rc = launch_local([sys.executable, __file__, str(tmp_path / "ckpt")], 2, local_devices=2, timeout_s=240, output=out)
    results = {
        r["process"]: r
        for r in (json.loads(line.split("RESULT ", 1)[1]) for line in out.getvalue().splitlines() if "RESULT " in line)
    }
    assert rc == 0 and set(results) == {0, 1}, out.getvalue()[-3000:]
    assert results[0]["saved"] == results[1]["saved"] and len(results[0]["saved"]) >= 3
    assert all(s % 5 == 0 for s in results[0]["saved"])
    assert results[0]["stopped_at"] == results[1]["stopped_at"] == 35  # the first agreed step after the signal


if __name__ == "__main__":
    print("RESULT " + json.dumps(worker(sys.argv[1])), flush=True)
