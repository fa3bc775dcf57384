"""A checkpoint that cannot be written is said at once: checks at construction, a failed save said at that save and
counted, training goes on from the last good step, N failures in a row stop with a typed error after one last copy to
the replica. Faults are injected as `tests/_inject.py` says (an EROFS at the OS-call level, RLIMIT_FSIZE)."""

import errno
import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _inject import disk_full, file_size_limit, read_only

from openhosti_jax.checkpoint import CheckpointManager, CheckpointWarning
from openhosti_jax.checkpoint import faults as faults_module
from openhosti_jax.errors import CheckpointSaveError, NonFiniteError
from openhosti_jax.train import Trainer, TrainerCheckpoint

N = 1 << 21  # 8 MiB of float32: a file past file_size_limit(4 MiB)


def _state(step: int) -> dict:
    return {"w": jnp.arange(N, dtype=jnp.float32) + step, "step": jnp.int32(step)}


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _restored_equals(directory, step: int, **kw) -> bool:
    with CheckpointManager(directory, every_minutes=None, **kw) as ckpt:
        restored, _, _ = ckpt.restore(_abstract(_state(step)))
        assert ckpt.restored_step == step
    pairs = zip(jax.tree.leaves(restored), jax.tree.leaves(_state(step)), strict=True)
    return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)


def test_a_directory_that_is_a_file_is_refused_at_construction(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a folder")
    with pytest.raises(CheckpointSaveError) as e:
        CheckpointManager(path, every_minutes=None)
    assert e.value.step is None and e.value.path == str(path)
    assert str(path) in str(e.value) and "[Errno 20] Not a directory" in str(e.value)
    assert "a file stands where a folder should be" in str(e.value)


def test_a_read_only_directory_is_refused_at_construction(tmp_path):
    with read_only(tmp_path), pytest.raises(CheckpointSaveError) as e:
        CheckpointManager(tmp_path / "ckpt", every_minutes=None)
    assert "[Errno 30] Read-only file system" in str(e.value) and "writable disk" in str(e.value)


def test_too_little_space_for_two_checkpoints_is_an_error_or_a_warning(tmp_path, monkeypatch):
    state = _state(0)
    need = 4 * N + 4  # bytes of one checkpoint of the state, from its shapes
    assert faults_module.checkpoint_bytes(state) == need
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(faults_module.shutil, "disk_usage", lambda p: usage._replace(free=2 * need - 1))
    with CheckpointManager(tmp_path / "a", every_minutes=None) as ckpt:
        with pytest.raises(CheckpointSaveError, match=f"{2 * need:,} bytes.*found {2 * need - 1:,} bytes free"):
            ckpt.check_space(state)
    with CheckpointManager(tmp_path / "b", every_minutes=None, low_space="warn") as ckpt:
        with pytest.warns(CheckpointWarning, match="room for two checkpoints"):
            ckpt.check_space(state)
    monkeypatch.setattr(faults_module.shutil, "disk_usage", lambda p: usage._replace(free=2 * need))
    with CheckpointManager(tmp_path / "c", every_minutes=None) as ckpt:
        ckpt.check_space(state)  # exactly two fit


def test_a_directory_that_turns_read_only_fails_that_save_and_the_next_one_succeeds(tmp_path):
    with CheckpointManager(tmp_path, every_minutes=None, async_save=False) as ckpt:
        assert ckpt.maybe_save(2, _state(2), force=True)
        ckpt.wait()
        with read_only(tmp_path), pytest.warns(CheckpointWarning) as said:
            assert not ckpt.maybe_save(4, _state(4), force=True)
        message = str(said[0].message)
        for part in ("step 4", str(tmp_path / "4"), "[Errno 30] Read-only file system", "fix:", "last good step 2"):
            assert part in message, part
        assert ckpt.faults.count == 1 and ckpt.faults.consecutive == 1 and ckpt.good_steps() == [2]
        assert ckpt.maybe_save(6, _state(6), force=True)
        ckpt.wait()
        assert ckpt.good_steps() == [2, 6] and ckpt.faults.consecutive == 0 and ckpt.faults.count == 1
    assert _restored_equals(tmp_path, 6)


def test_a_disk_that_fills_up_mid_save_is_said_and_the_step_never_counts_as_good(tmp_path):
    with CheckpointManager(tmp_path, every_minutes=None) as ckpt:
        ckpt.maybe_save(2, _state(2), force=True)
        ckpt.wait()
        with file_size_limit(4 << 20), pytest.warns(CheckpointWarning, match="step 4 could not be written"):
            assert ckpt.maybe_save(4, _state(4), force=True)  # handed to Orbax: its write fails in the background
            with pytest.raises(CheckpointSaveError) as e:
                ckpt.wait()
        assert e.value.step == 4 and e.value.path == str(tmp_path / "4")
        assert "[Errno 27] File too large" in str(e.value) and "last good step 2 stays" in str(e.value)
        assert ckpt.good_steps() == [2] and sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["2"]
        ckpt.close()  # the failure was raised once: closing raises nothing more
    assert _restored_equals(tmp_path, 2)


def test_failures_in_a_row_stop_the_run_after_one_last_copy_to_the_replica(tmp_path):
    local, replica = tmp_path / "local", tmp_path / "replica"
    with CheckpointManager(local, every_minutes=None, replicate_to=replica, max_failures=3) as ckpt:
        ckpt.maybe_save(2, _state(2), force=True)
        ckpt.wait()
        with read_only(local), warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            assert not ckpt.maybe_save(4, _state(4), force=True)
            assert not ckpt.maybe_save(6, _state(6), force=True)
            with pytest.raises(CheckpointSaveError) as e:
                ckpt.maybe_save(8, _state(8), force=True)
        assert e.value.step == 8 and "the run stops now" in str(e.value)
        assert any("saved to the replica" in n for n in e.value.__notes__)
        assert ckpt.stopped is e.value and not ckpt.maybe_save(10, _state(10), force=True)
        assert ckpt.good_steps() == [2] and ckpt.replica_steps() == [2, 8]
    shutil.rmtree(local)  # a fresh machine: the replica's step 8 is fetched and verifies
    assert _restored_equals(local, 8, replicate_to=replica)


def test_close_raises_the_first_error_and_keeps_the_later_ones_as_notes(tmp_path):
    ckpt = CheckpointManager(tmp_path, every_minutes=None)
    with file_size_limit(4 << 20), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        ckpt.maybe_save(4, _state(4), force=True)
        real_close = ckpt._mgr.close

        def failing_close():
            real_close()
            raise OSError(errno.EIO, "Input/output error")

        ckpt._mgr.close = failing_close
        with pytest.raises(CheckpointSaveError) as e:
            ckpt.close()
    assert e.value.step == 4 and e.value.__notes__ == ["then: OSError: [Errno 5] Input/output error"]


def _loss_step(state, batch):
    w = state["w"] - 0.5 * (state["w"] - batch)
    return {"w": w, "step": state["step"] + 1}, {"loss": jnp.mean((state["w"] - batch) ** 2)}


def test_the_trainer_counts_failed_saves_and_ends_at_the_state_of_a_run_without_checkpoints(tmp_path):
    batches = [jnp.full((8,), float(i)) for i in range(8)]
    reference = {"w": jnp.zeros(8), "step": jnp.int32(0)}
    for b in batches:
        reference, _ = _loss_step(reference, b)
    fault = read_only(tmp_path / "ckpt")
    calls = []
    jitted = jax.jit(_loss_step)

    def step(state, batch):  # the directory is read-only from the 4th step to the 6th
        calls.append(1)
        if len(calls) == 4:
            ckpt.manager.wait()  # step 2's background write is done (it would fail too)
            fault.__enter__()
        if len(calls) == 7:
            fault.__exit__(None, None, None)
        return jitted(state, batch)

    ckpt = TrainerCheckpoint(tmp_path / "ckpt", every_minutes=None, every_steps=2, max_failures=None)
    with pytest.warns(CheckpointWarning) as said:
        result = Trainer(step, progress=False, log_every=1, checkpoint=ckpt, metrics_path=tmp_path / "m.jsonl").fit(
            {"w": jnp.zeros(8), "step": jnp.int32(0)}, batches, num_steps=8
        )
    assert sorted({str(w.message).split(" could")[0] for w in said}) == ["checkpoint step 4", "checkpoint step 6"]
    assert np.array_equal(result.state["w"], reference["w"]) and int(result.state["step"]) == 8
    logged = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    # a step's record is written before its save: step 4's failure shows from step 5 on
    assert [r["checkpoint_failures"] for r in logged] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [2, 8]


def test_a_run_whose_every_update_is_not_finite_ends_with_a_typed_error():
    def step(state, batch):
        bad = state["step"] >= 3
        loss = jnp.where(bad, jnp.nan, 1.0 / (state["step"] + 1))
        return {"step": state["step"] + jnp.where(bad, 0, 1)}, {"loss": loss, "skipped_nonfinite": bad.astype(int)}

    trainer = Trainer(jax.jit(step), progress=False, log_every=4, max_nonfinite=5)
    with pytest.raises(NonFiniteError, match=r"5 steps in a row .* batch 8 \(step 3; last finite loss: 0.333333\)"):
        trainer.fit({"step": jnp.int32(0)}, iter(lambda: jnp.zeros(2), None), num_steps=100)


def _sigterm_save(ckpt, step):
    import os
    import signal

    ckpt.save_on_signal()
    os.kill(os.getpid(), signal.SIGTERM)
    return ckpt.maybe_save(step, _state(step))  # not due by the schedule: the signal asks for it


def test_sigterm_on_a_full_disk_still_writes_the_emergency_checkpoint_to_the_replica(tmp_path):
    local, replica = tmp_path / "local", tmp_path / "replica"
    ckpt = CheckpointManager(local, every_minutes=None, replicate_to=replica)
    ckpt.maybe_save(2, _state(2), force=True)
    ckpt.wait()
    with disk_full(local), pytest.warns(CheckpointWarning, match="No space left.*saved to the replica .* instead"):
        _sigterm_save(ckpt, 5)  # the local disk is full; the replica's copy goes through /tmp
    assert ckpt.preempted and ckpt.good_steps() == [2] and ckpt.replica_steps() == [2, 5]
    ckpt.close()
    shutil.rmtree(local)
    assert _restored_equals(local, 5, replicate_to=replica)


def test_sigterm_on_a_full_disk_without_a_replica_says_it_could_not_save(tmp_path):
    ckpt = CheckpointManager(tmp_path, every_minutes=None)
    with file_size_limit(4 << 20), pytest.raises(CheckpointSaveError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        _sigterm_save(ckpt, 5)
    assert e.value.step == 5 and "File too large" in str(e.value)
    assert any("saved nowhere" in n for n in e.value.__notes__)
    ckpt.close()
