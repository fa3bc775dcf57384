"""A checkpoint saved by 2 processes (2 x 4 devices) restores in 1 process (8 devices) and vice versa.

Reference: the saving run continues without interruption; the resumed run must give the same later losses.
A crashed 2-process run restarted by `run_with_restarts` resumes and ends with the uninterrupted losses.
Run as a script (through `launch_local`), this file is one worker: ``python FILE save|resume|auto DIR``.
"""

import io
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVE_AT, STEPS = 2, 4


def _job():
    from openhosti_jax.mesh import MeshConfig
    from openhosti_jax.models.gpt_job import GPTJob, build_job

    job = GPTJob(steps=STEPS, global_batch=16, num_sequences=256, mesh=MeshConfig(data=1, fsdp=8), progress=False)
    return build_job(job)


def _train(step, state, data, n):
    losses = []
    for _ in range(n):
        state, m = step(state, next(data))
        losses.append(float(m["loss"]))
    return state, losses


def save_run(directory: str) -> dict:
    """Train SAVE_AT steps, save synchronously, then go on to STEPS (the uninterrupted reference)."""
    from openhosti_jax.checkpoint import CheckpointManager

    state, _, step, data = _job()
    state, first = _train(step, state, data, SAVE_AT)
    with CheckpointManager(directory, every_minutes=None, async_save=False) as ckpt:
        assert ckpt.maybe_save(SAVE_AT, state, data_state=data.get_state(), force=True)
        ckpt.wait()
    _, rest = _train(step, state, data, STEPS - SAVE_AT)
    return {"losses": first + rest}


def resume_run(directory: str) -> dict:
    """Restore the latest step onto this run's mesh and train to STEPS."""
    import jax

    from openhosti_jax.checkpoint import CheckpointManager

    state, _, step, data = _job()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with CheckpointManager(directory, every_minutes=None, async_save=False) as ckpt:
        state, data_state, _ = ckpt.restore(abstract)
    data.set_state(data_state)
    assert int(state.step) == SAVE_AT
    _, rest = _train(step, state, data, STEPS - SAVE_AT)
    return {"losses": rest}


def auto_run(directory: str) -> dict:
    """Save every step; on the first attempt process 1 dies after step 3 (before saving it); resume on restarts."""
    import jax

    from openhosti_jax.checkpoint import RESTART_ENV, CheckpointManager

    state, _, step, data = _job()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    losses = []
    with CheckpointManager(directory, every_minutes=None, every_steps=1, async_save=False) as ckpt:
        if ckpt.latest_good_step() is not None:
            state, data_state, _ = ckpt.restore(abstract)
            data.set_state(data_state)
        start = int(state.step)
        for i in range(start, STEPS):
            state, m = step(state, next(data))
            losses.append(float(m["loss"]))
            if os.environ.get(RESTART_ENV) == "0" and i + 1 == 3 and jax.process_index() == 1:
                os._exit(3)
            ckpt.maybe_save(i + 1, state, data_state=data.get_state())
            ckpt.wait()
    return {"start": start, "losses": losses}


def _launch_two(mode: str, directory: str) -> dict:
    from openhosti_jax.mesh.launch import launch_local

    log = io.StringIO()
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, os.path.abspath(__file__), mode, directory]
    rc = launch_local(cmd, 2, local_devices=4, env=env, timeout_s=240, kill_grace_s=2, output=log)
    assert rc == 0, log.getvalue()[-4000:]
    found = [json.loads(x.split("RESULT ", 1)[1]) for x in log.getvalue().splitlines() if "RESULT " in x]
    assert len(found) == 2 and found[0]["losses"] == found[1]["losses"], found
    return found[0]


def _close(a, b):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_saved_by_two_processes_restores_in_one(tmp_path):
    saved = _launch_two("save", str(tmp_path / "ckpt"))
    resumed = resume_run(str(tmp_path / "ckpt"))
    assert _close(resumed["losses"], saved["losses"][SAVE_AT:]), (resumed, saved)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_saved_by_one_process_restores_in_two(tmp_path):
    saved = save_run(str(tmp_path / "ckpt"))
    resumed = _launch_two("resume", str(tmp_path / "ckpt"))
    assert _close(resumed["losses"], saved["losses"][SAVE_AT:]), (resumed, saved)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_auto_restart_of_a_crashed_two_process_run_reaches_the_uninterrupted_final_loss(tmp_path):
    from openhosti_jax.checkpoint import run_with_restarts

    log = tmp_path / "log.txt"
    launcher = (
        "import sys; from openhosti_jax.mesh.launch import launch_local; "
        f"sys.exit(launch_local([sys.executable, {os.path.abspath(__file__)!r}, 'auto', {str(tmp_path / 'c')!r}], "
        f"2, local_devices=4, timeout_s=180, kill_grace_s=2, output=open({str(log)!r}, 'a')))"
    )
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc = run_with_restarts([sys.executable, "-c", launcher], max_restarts=2, backoff_s=0.0, env=env)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    found = [json.loads(x.split("RESULT ", 1)[1]) for x in text.splitlines() if "RESULT " in x]
    assert len(found) == 2 and all(r["start"] == SAVE_AT for r in found), found  # resumed from step 2
    state, _, step, data = _job()
    _, ref = _train(step, state, data, STEPS)  # uninterrupted, 1 process x 8 devices
    for r in found:
        assert _close(r["losses"], ref[SAVE_AT:]), (r, ref)


if __name__ == "__main__":
    from openhosti_jax.mesh import initialize_distributed

    assert initialize_distributed(timeout_s=60)
    import jax

    mode, directory = sys.argv[1], sys.argv[2]
    out = {"save": save_run, "resume": resume_run, "auto": auto_run}[mode](directory)
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()
