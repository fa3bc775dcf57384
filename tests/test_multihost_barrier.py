"""Barriers and agreement checks across 2 real processes: they pass when all arrive, name the missing one otherwise.

Run as a script (through `launch_local`), this file is one worker.
"""

import io
import json
import os
import sys
import time

import pytest

from openhosti_jax.errors import ConfigError, DistributedError
from openhosti_jax.mesh.barrier import agree, barrier
from openhosti_jax.mesh.launch import launch_local

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker() -> None:
    from openhosti_jax.mesh import initialize_distributed

    assert initialize_distributed(timeout_s=60)
    import jax

    me = jax.process_index()
    out: dict = {"process": me}
    barrier("start", timeout_s=30)
    out["same"] = agree("same", "plan-A", timeout_s=30)
    try:
        agree("differ", f"plan-{me}", timeout_s=30)
    except DistributedError as e:
        out["differ_error"] = str(e)
    if me == 0:  # process 1 never comes to this barrier
        t0 = time.monotonic()
        try:
            barrier("late", timeout_s=3)
        except DistributedError as e:
            out["late_error"], out["late_seconds"] = str(e), time.monotonic() - t0
    else:
        time.sleep(6)
    barrier("end", timeout_s=60)  # both arrive again: the runtime is still usable after a timeout
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def test_single_process_barrier_and_agree_are_no_ops_but_check_their_input():
    barrier("x", timeout_s=1)
    assert agree("x", "v") == "v"
    with pytest.raises(ConfigError, match="without '/'"):
        barrier("a/b")
    with pytest.raises(ConfigError, match="timeout_s"):
        barrier("a", timeout_s=0)
    with pytest.raises(ConfigError, match="must be a str"):
        agree("a", 3)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_processes_barrier_agree_and_a_timeout_naming_the_missing_process():
    log = io.StringIO()
    rc = launch_local(
        [sys.executable, os.path.abspath(__file__)],
        2,
        local_devices=1,
        env={"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
        timeout_s=150,
        kill_grace_s=2,
        output=log,
    )
    text = log.getvalue()
    assert rc == 0, text[-3000:]
    results = {}
    for line in text.splitlines():
        if "RESULT " in line:
            r = json.loads(line.split("RESULT ", 1)[1])
            results[r["process"]] = r
    assert set(results) == {0, 1}, text[-3000:]
    for r in results.values():
        assert r["same"] == "plan-A"
        assert "process 1: 'plan-1'" in r["differ_error"] and "'plan-0'" in r["differ_error"]
    late = results[0]["late_error"]
    assert "arrived: process 1." in late and "'late'" in late and "1 of 2" in late
    assert 3 <= results[0]["late_seconds"] < 10
    assert "late_error" not in results[1]


if __name__ == "__main__":
    worker()
