"""The demo GPT on 2 processes x 4 CPU devices (gloo) matches 1 process x 8 devices; a killed process ends the job."""

import io
import json
import os
import re
import signal
import sys
import threading
import time

import pytest

from openhosti_jax.mesh import MeshConfig
from openhosti_jax.mesh.launch import launch_local
from openhosti_jax.models.gpt_job import GPTJob, build_job
from openhosti_jax.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "examples", "multihost_worker.py")
ENV = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
STEPS, BATCH, SEQS = 4, 16, 256


def results(text: str) -> dict[int, dict]:
    out = {}
    for line in text.splitlines():
        if "RESULT " in line:
            r = json.loads(line.split("RESULT ", 1)[1])
            out[r["process"]] = r
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_fsdp_losses_equal_one_process_with_the_same_eight_devices():
    log = io.StringIO()
    cmd = [sys.executable, WORKER, "--steps", str(STEPS), "--batch", str(BATCH), "--sequences", str(SEQS)]
    rc = launch_local(cmd, 2, local_devices=4, env=ENV, timeout_s=240, kill_grace_s=2, output=log)
    assert rc == 0, log.getvalue()[-4000:]
    got = results(log.getvalue())
    assert set(got) == {0, 1}

    # Reference: this (single) process with its 8 devices, same job, the full global batch on one host.
    job = GPTJob(steps=STEPS, global_batch=BATCH, num_sequences=SEQS, mesh=MeshConfig(data=1, fsdp=8), progress=False)
    state, plan, step, data = build_job(job)
    assert plan.mesh_shape["fsdp"] == 8
    ref = [h["loss"] for h in Trainer(step, progress=False).fit(state, data, num_steps=STEPS).history]
    assert ref[-1] < ref[0]  # it trains
    for r in got.values():
        assert len(r["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(r["losses"], ref, strict=True)) < 1e-5, (r["losses"], ref)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killing_one_process_makes_the_launcher_return_nonzero_within_60s():
    log = io.StringIO()
    cmd = [sys.executable, WORKER, "--steps", "100000", "--batch", "16", "--sequences", "256", "--step-sleep", "0.1"]
    box = {}

    def launch():
        box["rc"] = launch_local(cmd, 2, local_devices=4, env=ENV, timeout_s=250, kill_grace_s=5, output=log)
        box["end"] = time.monotonic()

    t = threading.Thread(target=launch, daemon=True)
    t.start()
    deadline = time.monotonic() + 200
    while "[p1] step 2 " not in log.getvalue():
        assert t.is_alive() and time.monotonic() < deadline, log.getvalue()[-4000:]
        time.sleep(0.2)
    pid = int(re.search(r"\[p1\] process 1/2 pid (\d+)", log.getvalue()).group(1))
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(timeout=120)
    assert not t.is_alive(), log.getvalue()[-4000:]
    assert box["rc"] != 0
    assert box["end"] - killed < 60, box["end"] - killed
    assert "RESULT" not in log.getvalue()
