"""A checkpoint saved by 2 processes (2 x 4 devices) restores in 1 process (8 devices) and vice versa.

Reference: the saving run continues without interruption; the resumed run must give the same later losses.
Run as a script (through `launch_local`), this file is one worker: ``python FILE save|resume DIR``.
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


if __name__ == "__main__":
    from openhosti_jax.mesh import initialize_distributed

    assert initialize_distributed(timeout_s=60)
    import jax

    mode, directory = sys.argv[1], sys.argv[2]
    out = save_run(directory) if mode == "save" else resume_run(directory)
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()
