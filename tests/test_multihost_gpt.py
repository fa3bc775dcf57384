"""The demo GPT on 2 processes x 4 CPU devices (gloo) matches 1 process x 8 devices; a killed process ends the job."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from openhosti_jax.demo.gpt_job import GPTJob, build_job
from openhosti_jax.mesh import MeshConfig
from openhosti_jax.mesh.launch import launch_local
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


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_killed_process_stops_its_peer_and_both_supervisors_resume_to_the_finished_step(tmp_path):
    """As in examples/k8s/jobset.yaml: every process under its own `openhosti run`, rank from JOB_COMPLETION_INDEX.

    Process 1 is SIGKILLed after the step-5 checkpoint; the coordinator misses its heartbeats and jax ends process 0
    (no hang); both supervisors restart their process after the backoff, and both resume from a checkpoint and
    finish with the losses of an uninterrupted run of the same two processes.
    """
    from openhosti_jax.checkpoint.checksums import has_checksums
    from openhosti_jax.mesh.launch import child_env, free_port

    example = os.path.join(ROOT, "examples", "cluster_gpt.py")
    args = ["--steps", "20", "--batch", "8", "--sequences", "64", "--d-model", "32", "--layers", "1", "--seq-len", "16"]
    args += ["--checkpoint-every", "5"]
    ckpt, port = tmp_path / "ckpt", free_port()
    base = {**os.environ, **ENV, "OPENHOSTI_HEARTBEAT_TIMEOUT_S": "10"}
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    supervisors = [
        subprocess.Popen(
            [sys.executable, "-m", "openhosti_jax.cli", "run", "--max-restarts", "2", "--backoff-s", "15", "--"]
            + [sys.executable, example, "--checkpoint-dir", str(ckpt), *args],
            env=child_env(i, 2, f"127.0.0.1:{port}", 2, base, launcher="jobset"),
            stdout=open(logs[i], "w"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "5").is_dir() or not has_checksums(ckpt / "5"):
            assert time.monotonic() < deadline and all(s.poll() is None for s in supervisors), logs[0].read_text()
            time.sleep(0.1)
        pid = int(re.search(r"jobset: process 1/2 pid (\d+)", logs[1].read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while "restart 1/2" not in logs[0].read_text():  # process 0 exited and its supervisor noticed
            assert time.monotonic() - killed < 60, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        stopped_after = time.monotonic() - killed
        for s in supervisors:
            assert s.wait(timeout=240) == 0, [p.read_text()[-3000:] for p in logs]
    finally:
        for s in supervisors:
            s.kill()
    texts = [p.read_text() for p in logs]
    assert all(t.count("; restart ") == 1 for t in texts), texts
    got = [json.loads(t.split("RESULT ", 1)[1].splitlines()[0]) for t in texts]
    assert [r["process"] for r in got] == [0, 1] and got[0]["losses"] == got[1]["losses"]
    start = got[0]["start"]
    assert start >= 5 and start % 5 == 0 and start + len(got[0]["losses"]) == 20, got[0]

    log = io.StringIO()  # the reference: the same two processes, never interrupted
    cmd = [sys.executable, example, "--checkpoint-dir", str(tmp_path / "ref"), *args]
    rc = launch_local(cmd, 2, local_devices=2, launcher="jobset", env=ENV, timeout_s=200, kill_grace_s=2, output=log)
    assert rc == 0, log.getvalue()[-3000:]
    ref = next(json.loads(x.split("RESULT ", 1)[1]) for x in log.getvalue().splitlines() if "RESULT " in x)
    assert got[0]["losses"] == ref["losses"][start:]  # bitwise: the same programs on the same restored state
    print(f"\nsurvivor stopped {stopped_after:.1f}s after the kill; resumed from step {start}")
