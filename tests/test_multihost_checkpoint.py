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
    from openhosti_jax.demo.gpt_job import GPTJob, build_job
    from openhosti_jax.mesh import MeshConfig

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


def corrupt_run(directory: str) -> dict:
    """Process 1 damages a chunk only it reads; both processes must refuse the step (they agree), naming it."""
    import jax
    from jax.experimental import multihost_utils

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.checkpoint.checksums import device_boxes, read_grid
    from openhosti_jax.checkpoint.flat import abstract_flat
    from openhosti_jax.errors import CheckpointCorruptError

    state, _, _, _ = _job()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    step_dir = os.path.join(directory, str(SAVE_AT))
    readers: dict[str, set[int]] = {}
    for name, t in sorted(abstract_flat(abstract).items()):
        grid = read_grid(step_dir, name)
        for device, box in device_boxes(t.shape, t.sharding):
            for index in grid.overlapping(box):
                readers.setdefault(f"state/{name}/{grid.key(index)}", set()).add(device.process_index)
    victim = next(rel for rel, procs in sorted(readers.items()) if procs == {1})
    if jax.process_index() == 1:
        path = os.path.join(step_dir, victim)
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x10
        open(path, "wb").write(bytes(data))
    multihost_utils.sync_global_devices("damaged")
    with CheckpointManager(directory, every_minutes=None, async_save=False) as ckpt:
        try:
            ckpt.restore(abstract)
        except CheckpointCorruptError as e:
            return {"losses": [], "victim": victim, "error": str(e)}
    return {"losses": [], "victim": victim, "error": None}


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


def _check_records(step_dir) -> None:
    """Two processes wrote one record each: disjoint, together every item file, process 1's only its chunks."""
    from openhosti_jax.checkpoint.checksums import has_checksums, item_files, record_files

    records = {p.name: json.loads(p.read_text())["files"] for p in record_files(step_dir)}
    assert sorted(records) == ["openhosti_checksums.0-of-2.json", "openhosti_checksums.1-of-2.json"], records
    first, second = records["openhosti_checksums.0-of-2.json"], records["openhosti_checksums.1-of-2.json"]
    assert has_checksums(step_dir) and not set(first) & set(second)
    assert sorted(set(first) | set(second)) == item_files(step_dir)
    assert second and all(r.startswith("state/") and not r.rsplit("/", 1)[1].startswith(".") for r in second)
    assert "state/array_metadatas/process_1" in second and "meta/metadata" in first


@pytest.mark.timeout(120)
def test_each_process_records_the_files_it_wrote(tmp_path):
    """Devices 0-3 play process 0 and 4-7 process 1: who writes each chunk follows from the sharding."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.checkpoint.checksums import (
        files_written_by,
        has_checksums,
        item_files,
        record_checksums,
        record_files,
    )

    flat = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    grid = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jnp.arange(128.0).reshape(16, 8)
    state = {
        "fsdp": jax.device_put(x, NamedSharding(flat, PartitionSpec("fsdp"))),  # each device its own rows
        "replicated": jax.device_put(x, NamedSharding(flat, PartitionSpec())),  # replica r writes piece r
        "dp": jax.device_put(x, NamedSharding(grid, PartitionSpec("fsdp"))),  # 2 replicas, one per process
        "scalar": jnp.int32(3),
        "host": np.float32(1.0),  # not a jax.Array: written by process 0
    }
    with CheckpointManager(tmp_path, every_minutes=None) as ckpt:
        ckpt.maybe_save(1, state, force=True)
    step_dir = tmp_path / "1"
    for p in record_files(step_dir):
        p.unlink()
    arrays = {k: (v.shape, v.sharding) for k, v in state.items() if isinstance(v, jax.Array)}
    files = item_files(step_dir)
    mine = [files_written_by(step_dir, arrays, p, files, process_of=lambda d: d.id // 4) for p in (0, 1)]
    assert sorted(mine[0] + mine[1]) == files and not set(mine[0]) & set(mine[1])
    assert mine[1] == [
        *(f"state/dp/{i}.0" for i in (1, 3, 5, 7)),  # the second replica's half of each fsdp shard
        *(f"state/fsdp/{i}.0" for i in range(4, 8)),
        *(f"state/replicated/{i}.0" for i in range(4, 8)),
    ]
    assert {"state/scalar/0", "state/host/0", "state/fsdp/.zarray", "meta/metadata"} <= set(mine[0])
    record_checksums(step_dir, mine[1], process=1, process_count=2)
    assert not has_checksums(step_dir)  # process 0's record is still missing
    record_checksums(step_dir, mine[0], process=0, process_count=2)
    assert has_checksums(step_dir)
    with CheckpointManager(tmp_path, every_minutes=None) as ckpt:
        assert ckpt.verify(1) == []
        (step_dir / "state" / "fsdp" / "6.0").write_bytes(b"")
        assert ckpt.verify(1) == ["array 'fsdp': file state/fsdp/6.0 has 0 bytes, 64 were written (truncated?)"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_saved_by_two_processes_restores_in_one(tmp_path):
    saved = _launch_two("save", str(tmp_path / "ckpt"))
    _check_records(tmp_path / "ckpt" / str(SAVE_AT))
    resumed = resume_run(str(tmp_path / "ckpt"))
    assert _close(resumed["losses"], saved["losses"][SAVE_AT:]), (resumed, saved)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_saved_by_one_process_restores_in_two(tmp_path):
    saved = save_run(str(tmp_path / "ckpt"))
    resumed = _launch_two("resume", str(tmp_path / "ckpt"))
    assert _close(resumed["losses"], saved["losses"][SAVE_AT:]), (resumed, saved)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_chunk_damaged_where_only_process_1_reads_it_stops_both_processes(tmp_path):
    from openhosti_jax.mesh.launch import launch_local

    save_run(str(tmp_path / "ckpt"))
    log = io.StringIO()
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, os.path.abspath(__file__), "corrupt", str(tmp_path / "ckpt")]
    rc = launch_local(cmd, 2, local_devices=4, env=env, timeout_s=240, kill_grace_s=2, output=log)
    assert rc == 0, log.getvalue()[-4000:]
    found = {x[:4]: json.loads(x.split("RESULT ", 1)[1]) for x in log.getvalue().splitlines() if "RESULT " in x}
    assert sorted(found) == ["[p0]", "[p1]"], log.getvalue()[-4000:]
    victim = found["[p0]"]["victim"]
    assert found["[p1]"]["victim"] == victim and victim.startswith("state/")
    for p, result in found.items():
        assert result["error"] is not None, (p, result)
        assert f"file {victim} has checksum" in result["error"], (p, result["error"])
    assert "(found by process 1)" in found["[p0]"]["error"]


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
    out = {"save": save_run, "resume": resume_run, "auto": auto_run, "corrupt": corrupt_run}[mode](directory)
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()
