"""Two processes, each with its own local checkpoint directory (no shared filesystem), and a replica.

The reference is the same 2-process job run without interruption. A second run saves every step (both tiers) and
is killed after step KILL_AT; then one of these failures is staged before a 2-process resume:

- process 1's local directory is deleted (a replaced machine): it resumes from the replica, process 0 from its disk;
- the same, and the replica's newest step is half copied (process 1's share and record missing, as after a kill
  mid-upload): both resume from the previous complete step;
- a chunk in process 0's newest local step is flipped: that process fetches the step from the replica.

Apart from those, the reference's replica alone (no local directory) is restored in one process with 8 devices,
on the saving mesh and on another: the state must be the one the 2 processes saved, bit for bit.

Each resumed run must give the reference's losses bit for bit from the step it resumed at, its final parameters
equal the reference's bit for bit, and consume the reference's batches in the reference's order (no sample lost or
repeated). Run as a script (through `launch_local`), this file is one worker: ``python FILE MODE DIR``.
"""

import hashlib
import io
import json
import os
import shutil
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, KILL_AT = 6, 4
pytestmark = [pytest.mark.slow]


def _job(data: int = 1, fsdp: int = 8):
    from openhosti_jax.demo.gpt_job import GPTJob, build_job
    from openhosti_jax.mesh import MeshConfig

    job = GPTJob(steps=STEPS, global_batch=16, num_sequences=256, mesh=MeshConfig(data=data, fsdp=fsdp), progress=False)
    return build_job(job)


def _digest(tree) -> str:
    """A digest of every array's global value (bitwise), the same on every process."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        value = multihost_utils.process_allgather(leaf, tiled=True) if isinstance(leaf, jax.Array) else leaf
        h.update(np.ascontiguousarray(np.asarray(value)).tobytes())
    return h.hexdigest()


def run(mode: str, base: str) -> dict:
    """``reference``: STEPS steps, saving every step; ``killed``: the same, exiting after step KILL_AT's save;
    ``resume``: restore the newest step every process can get and train to STEPS."""
    import jax

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.mesh.barrier import barrier

    me = jax.process_index()
    state, _, step, data = _job()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    out = {"losses": {}, "positions": {}, "start": 0, "fetched": None}
    local = os.path.join(base, f"local{me}")  # each process its own directory, never the other's
    with CheckpointManager(
        local, every_minutes=None, every_steps=1, keep=3, replicate_to=os.path.join(base, "replica")
    ) as ckpt:
        assert not ckpt.shared
        out["fetched"] = ckpt.fetched_step
        if mode == "resume":
            out["latest"] = ckpt.latest_good_step()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state, data_state, _ = ckpt.restore(abstract)
            out["warnings"] = [str(w.message) for w in caught]
            data.set_state(data_state)
            out["start"] = ckpt.restored_step
            out["verified"] = ckpt.verify(out["start"])
        for i in range(int(state.step), STEPS):
            out["positions"][i] = json.dumps(data.get_state(), sort_keys=True)
            state, m = step(state, next(data))
            out["losses"][i] = float(m["loss"])
            ckpt.maybe_save(i + 1, state, data_state=data.get_state())
            ckpt.wait()  # both tiers, so the replica's newest step is known to the test
            if mode == "killed" and i + 1 == KILL_AT:
                print("RESULT " + json.dumps(out), flush=True)
                barrier("both-saved", timeout_s=300)  # both waited for step KILL_AT on both tiers
                os._exit(0)  # a crash: no close, no shutdown (the peer may die of the lost coordinator first)
        out["good"] = ckpt.good_steps()
    out["digest"] = _digest(state)
    out["data_state"] = data.get_state()  # what the last step's save recorded
    return out


def _launch(mode: str, base) -> dict[int, dict]:
    from openhosti_jax.mesh.launch import launch_local

    log = io.StringIO()
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, os.path.abspath(__file__), mode, str(base)]
    rc = launch_local(cmd, 2, local_devices=4, env=env, timeout_s=400, kill_grace_s=2, output=log)
    assert rc == 0 or mode == "killed", log.getvalue()[-6000:]
    found = {int(x[2]): json.loads(x.split("RESULT ", 1)[1]) for x in log.getvalue().splitlines() if "RESULT " in x}
    assert sorted(found) == [0, 1], log.getvalue()[-6000:]
    for r in found.values():
        r["losses"] = {int(k): v for k, v in r["losses"].items()}
        r["positions"] = {int(k): v for k, v in r["positions"].items()}
    return found


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """(the reference results, its folder: local0, local1, replica)."""
    base = tmp_path_factory.mktemp("reference")
    return _launch("reference", base), base


@pytest.fixture(scope="module")
def runs(reference_run, tmp_path_factory):
    """(the reference results, the folder of the killed run: local0, local1, replica)."""
    killed = tmp_path_factory.mktemp("killed")
    _launch("killed", killed)
    return reference_run[0], killed


def _stage(runs, tmp_path):
    base = tmp_path / "run"
    shutil.copytree(runs[1], base)
    return base


def _assert_resumed_like_reference(resumed: dict[int, dict], reference: dict[int, dict], start: int) -> None:
    ref = reference[0]
    for p, r in resumed.items():
        assert r["start"] == start, (p, r)
        assert r["losses"] == {i: ref["losses"][i] for i in range(start, STEPS)}, (p, r["losses"], ref["losses"])
        assert r["positions"] == {i: ref["positions"][i] for i in range(start, STEPS)}, p  # same batches, in order
        assert r["digest"] == ref["digest"], p
    assert reference[0]["losses"] == reference[1]["losses"]


def _replica_steps(base) -> list[int]:
    from openhosti_jax.checkpoint.replicate import replica_steps

    return replica_steps(str(base / "replica"))


@pytest.mark.timeout(600)
def test_a_host_that_lost_its_local_directory_resumes_from_the_replica(runs, tmp_path):
    base = _stage(runs, tmp_path)
    assert _replica_steps(base)[-1] == KILL_AT
    shutil.rmtree(base / "local1")  # the machine was replaced; process 0's disk survives
    resumed = _launch("resume", base)
    assert resumed[0]["fetched"] is None and resumed[1]["fetched"] == KILL_AT
    assert resumed[0]["warnings"] == resumed[1]["warnings"] == []  # process 0 read its own copy: it verified
    _assert_resumed_like_reference(resumed, runs[0], KILL_AT)


@pytest.mark.timeout(600)
def test_a_half_copied_newest_replica_step_is_passed_over(runs, tmp_path):
    from openhosti_jax.checkpoint.checksums import record_name

    base = _stage(runs, tmp_path)
    shutil.rmtree(base / "local1")
    newest = base / "replica" / str(KILL_AT)
    (newest / record_name(1, 2)).unlink()  # process 1's upload was killed before its record: the step is not whole
    for chunk in sorted((newest / "state").glob("*/[0-9]*"))[:3]:
        chunk.unlink()
    assert _replica_steps(base)[-1] == KILL_AT - 1
    resumed = _launch("resume", base)
    assert resumed[0]["latest"] == resumed[1]["latest"] == KILL_AT - 1  # process 0's step 4 is set aside
    assert resumed[0]["warnings"] == resumed[1]["warnings"] == []
    _assert_resumed_like_reference(resumed, runs[0], KILL_AT - 1)


@pytest.mark.timeout(600)
def test_a_corrupt_local_shard_on_one_host_is_fetched_from_the_replica(runs, tmp_path):
    base = _stage(runs, tmp_path)
    step_dir = base / "local0" / str(KILL_AT)
    victim = max((p for p in (step_dir / "state").glob("*/[0-9]*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    rel = victim.relative_to(step_dir).as_posix()
    resumed = _launch("resume", base)
    _assert_resumed_like_reference(resumed, runs[0], KILL_AT)
    for p in (0, 1):  # both saw process 0's damaged copy, named; then process 0 read the replica's
        assert any(f"file {rel} has checksum" in w and "falling back" in w for w in resumed[p]["warnings"]), p
    assert resumed[0]["verified"] == []  # its local step is the replica's intact copy now


@pytest.mark.timeout(900)
def test_the_replica_of_a_two_process_run_restores_onto_one_process_and_another_mesh(reference_run, tmp_path):
    """This pytest process is one process with 8 devices; the reference ran 2 processes of 4, saving per process."""
    import jax

    from openhosti_jax.checkpoint import CheckpointManager

    reference, saved = reference_run
    replica = tmp_path / "replica"
    shutil.copytree(saved / "replica", replica)  # read-only use, but the module's reference stays untouched
    assert jax.process_count() == 1 and jax.device_count() == 8
    assert _replica_steps(tmp_path)[-1] == STEPS
    assert reference[0]["digest"] == reference[1]["digest"]
    with CheckpointManager(tmp_path / "local", every_minutes=None, every_steps=None, replicate_to=replica) as ckpt:
        assert ckpt.shared and ckpt.fetched_step == STEPS  # no local step: the replica's newest is fetched
        assert ckpt.checkpoint_info(STEPS)["process_count"] == 2  # saved by the 2-process run
        for data, fsdp in ((1, 8), (2, 4)):  # the saving mesh, then another one
            state = _job(data, fsdp)[0]
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
            assert _digest(state) != reference[0]["digest"]  # a fresh state differs: the comparison can fail
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                restored, data_state, _ = ckpt.restore(abstract)
            passed_over = [str(w.message) for w in caught if "checkpoint" in str(w.message)]
            assert passed_over == [], (data, fsdp)  # no corrupt or unreadable copy was passed over
            assert ckpt.restored_step == STEPS and int(restored.step) == STEPS, (data, fsdp)
            leaves = zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True)
            on = [(r.sharding, a.sharding) for r, a in leaves]
            mesh = on[0][1].mesh.shape
            assert all(r == a for r, a in on) and (mesh["data"], mesh["fsdp"]) == (data, fsdp)
            assert data_state == reference[0]["data_state"], (data, fsdp)
            assert _digest(restored) == reference[0]["digest"], (data, fsdp)


if __name__ == "__main__":
    from openhosti_jax.mesh import initialize_distributed

    assert initialize_distributed(timeout_s=60)
    import jax

    result = run(sys.argv[1], sys.argv[2])
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()
