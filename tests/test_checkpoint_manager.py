"""CheckpointManager in one process: exact round trip, restore onto other meshes, policy, SIGTERM, replica."""

import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from openhosti_jax.checkpoint import CheckpointManager, SavePolicy
from openhosti_jax.errors import BatchError, CheckpointError, CheckpointMismatchError, ConfigError
from openhosti_jax.state import TrainState


def _mesh(n: int):
    return jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


def _state() -> TrainState:
    rs = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rs.normal(size=(16, 8)), jnp.float32),
        "b": jnp.asarray(rs.normal(size=(8,)), jnp.float32),
        "emb": jnp.asarray(rs.normal(size=(24, 4)), jnp.bfloat16),
    }
    state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2), rng=jax.random.key(5))
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    return state.apply_gradients(grads=grads).replace(step=jnp.int32(1))  # non-zero adam moments


def _fsdp_spec(leaf, n):
    shape = getattr(leaf, "shape", ())
    return PartitionSpec("fsdp") if len(shape) and shape[0] % n == 0 else PartitionSpec()


def _place(state, mesh, spec_fn):
    n = mesh.devices.size
    return jax.device_put(state, jax.tree.map(lambda x: NamedSharding(mesh, spec_fn(x, n)), state))


def _abstract(state, mesh, spec_fn):
    n = mesh.devices.size
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec_fn(x, n))), state
    )


def _host(tree):
    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _assert_same(a, b):
    ha, hb = jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))
    assert len(ha) == len(hb)
    for x, y in zip(ha, hb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def saved(tmp_path):
    """An FSDP state on 8 devices saved as step 3; (directory, reference state on host)."""
    state = _place(_state(), _mesh(8), _fsdp_spec)
    assert state.params["w"].sharding.spec == PartitionSpec("fsdp")
    with CheckpointManager(tmp_path, every_minutes=None) as ckpt:
        assert ckpt.maybe_save(
            3, state, data_state={"epoch": 1, "position": 2, "seed": 9}, meta={"plan": "fsdp"}, force=True
        )
        assert not ckpt.maybe_save(3, state, force=True)  # the same step is never written twice
    return tmp_path, state


@pytest.mark.timeout(120)
def test_round_trip_is_exact_and_keeps_data_state_and_meta(saved):
    directory, state = saved
    with CheckpointManager(directory, every_minutes=None) as ckpt:
        assert ckpt.latest_good_step() == 3 and ckpt.verify(3) == []
        restored, data_state, meta = ckpt.restore(_abstract(state, _mesh(8), _fsdp_spec))
        info = ckpt.checkpoint_info(3)
    _assert_same(restored, state)
    assert restored.params["w"].sharding.spec == PartitionSpec("fsdp")
    assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(  # the restored key draws the same numbers
        jax.random.uniform(restored.rng, (3,)), jax.random.uniform(state.rng, (3,))
    )
    assert data_state == {"epoch": 1, "position": 2, "seed": 9} and meta == {"plan": "fsdp"}
    assert info["mesh"] == {"fsdp": 8} and info["device_count"] == 8 and "params.w" in info["leaves"]


@pytest.mark.timeout(120)
def test_restore_on_four_devices_and_as_zero1(saved):
    directory, state = saved
    four = _mesh(4)
    with CheckpointManager(directory, every_minutes=None) as ckpt:
        on_four, _, _ = ckpt.restore(_abstract(state, four, _fsdp_spec))
        eight = _mesh(8)
        # ZeRO-1: parameters replicated, optimizer state sharded over fsdp
        abstract = _abstract(state, eight, _fsdp_spec)
        abstract = abstract.replace(params=_abstract(state.params, eight, lambda x, n: PartitionSpec()))
        zero1, _, _ = ckpt.restore(abstract)
    assert on_four.params["w"].sharding.mesh.devices.size == 4
    assert len(on_four.params["w"].addressable_shards) == 4
    assert on_four.params["w"].addressable_shards[0].data.shape == (4, 8)
    assert zero1.params["w"].sharding.is_fully_replicated
    assert zero1.opt_state[0].mu["w"].sharding.spec == PartitionSpec("fsdp")
    _assert_same(on_four, state)
    _assert_same(zero1, state)


@pytest.mark.timeout(120)
def test_policy_keep_and_every_steps(tmp_path):
    state = _state()
    with CheckpointManager(tmp_path, every_minutes=None, every_steps=2, keep=2) as ckpt:
        saved = [s for s in range(1, 8) if ckpt.maybe_save(s, state.replace(step=jnp.int32(s)))]
        ckpt.wait()
        assert saved == [2, 4, 6]
        assert ckpt.good_steps() == [4, 6]
        restored, _, _ = ckpt.restore(
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        )
        assert int(restored.step) == 6


@pytest.mark.timeout(60)
def test_every_minutes(tmp_path):
    state = {"x": jnp.ones(3)}
    now = [100.0]
    with CheckpointManager(tmp_path, every_minutes=0.5 / 60, clock=lambda: now[0]) as ckpt:
        assert not ckpt.maybe_save(1, state)
        now[0] += 0.49
        assert not ckpt.maybe_save(2, state)
        now[0] += 0.02  # 0.51 s since the manager started: due
        assert ckpt.maybe_save(3, state)
        assert not ckpt.maybe_save(4, state)  # the clock restarts at a save


def test_policy_validation():
    assert SavePolicy(every_minutes=None, every_steps=5).due(10, 0.0)
    assert SavePolicy(every_minutes=1.0).due(7, 61.0) and not SavePolicy(every_minutes=1.0).due(7, 59.0)
    for bad in ({"every_minutes": 0}, {"every_steps": 0}, {"keep": 0}, {"every_steps": 2.5}):
        with pytest.raises(ConfigError):
            SavePolicy(**bad)


@pytest.mark.timeout(60)
def test_sigterm_forces_a_save_at_the_next_step(tmp_path):
    state = {"x": jnp.arange(3.0)}
    previous = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(tmp_path, every_minutes=None) as ckpt:
        ckpt.save_on_signal()
        assert not ckpt.maybe_save(1, state) and not ckpt.preempted
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt.maybe_save(2, state)
        assert ckpt.preempted and ckpt.good_steps() == [2]  # committed and checksummed before returning
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.timeout(120)
def test_replica_receives_good_steps_and_serves_restores(tmp_path):
    state = _state()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with CheckpointManager(tmp_path / "main", every_minutes=None, keep=2, replicate_to=tmp_path / "copy") as ckpt:
        for s in (1, 2, 3):
            ckpt.maybe_save(s, state.replace(step=jnp.int32(s)), force=True)
        ckpt.wait()
        assert ckpt.replica_steps() == [2, 3] and ckpt.good_steps() == [2, 3]
        for s in (2, 3):  # the primary copy is lost
            shutil.rmtree(tmp_path / "main" / str(s))
        restored, _, _ = ckpt.restore(abstract)
    assert int(restored.step) == 3
    _assert_same(restored.params, state.params)


@pytest.mark.timeout(120)
def test_an_older_step_only_the_replica_holds_is_fetched_when_asked_for(tmp_path):
    """restore(step=k) of a step the local tier lost but the replica keeps fetches it, bit for bit."""
    state = _state()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with CheckpointManager(tmp_path / "main", every_minutes=None, keep=2, replicate_to=tmp_path / "copy") as ckpt:
        for s in (1, 2):
            scaled = state.replace(step=jnp.int32(s), params=jax.tree.map(lambda x, s=s: x * s, state.params))
            ckpt.maybe_save(s, scaled, force=True)
        ckpt.wait()
        shutil.rmtree(tmp_path / "main" / "1")
        assert ckpt.good_steps() == [2] and ckpt.replica_steps() == [1, 2]
        restored, _, _ = ckpt.restore(abstract, step=1)
        with pytest.raises(CheckpointError, match="or its replica"):
            ckpt.restore(abstract, step=7)
    assert int(restored.step) == 1
    _assert_same(restored.params, state.params)


@pytest.mark.timeout(60)
def test_bad_inputs_raise_typed_errors(tmp_path):
    state = {"x": jnp.ones(3)}
    with CheckpointManager(tmp_path, every_minutes=None) as ckpt:
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            ckpt.restore({"x": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=state["x"].sharding)})
        with pytest.raises(BatchError, match="JSON"):
            ckpt.maybe_save(1, state, data_state={"pos": (1, 2)}, force=True)
        with pytest.raises(ConfigError, match="JSON-able"):
            ckpt.maybe_save(1, state, meta={"f": object()}, force=True)
        ckpt.maybe_save(1, state, force=True)
        ckpt.wait()
        with pytest.raises(CheckpointError, match="with a sharding"):
            ckpt.restore({"x": jax.ShapeDtypeStruct((3,), jnp.float32)})
        with pytest.raises(CheckpointMismatchError, match=r"added .*\['y'\]"):
            ckpt.restore({"x": state["x"], "y": state["x"]})


@pytest.mark.timeout(120)
def test_a_machine_that_lost_its_local_disk_resumes_from_the_replica(tmp_path):
    """TrainerCheckpoint (what Trainer, `openhosti train` and the GPT job resume through) with the local directory
    gone restores the newest replicated step bit for bit; a replica step whose copy was cut short (its checksum
    records, copied last, missing) is never taken for a good one."""
    from openhosti_jax.checkpoint.checksums import record_files
    from openhosti_jax.train.resume import TrainerCheckpoint

    local, replica = tmp_path / "local", tmp_path / "replica"
    states = {s: {"w": jnp.arange(6.0) * s, "step": jnp.asarray(s)} for s in (2, 4, 6)}
    ckpt = TrainerCheckpoint(local, every_minutes=None, every_steps=2, keep=3, replicate_to=replica)
    for s, state in states.items():
        assert ckpt.save(s, state, None)
    ckpt.close()
    assert ckpt.manager.replica_steps() == [2, 4, 6]
    for record in record_files(replica / "6"):  # the newest upload was killed before its commit
        record.unlink()
    shutil.rmtree(local)  # the machine was replaced: its local disk is empty
    fresh = TrainerCheckpoint(local, every_minutes=None, every_steps=2, keep=3, replicate_to=replica)
    # on start the newest complete replica step was fetched onto the empty local tier (not the half-copied 6)
    assert fresh.manager.fetched_step == 4 and fresh.manager.good_steps() == [4]
    assert fresh.manager.latest_good_step() == 4
    restored = fresh.restore_latest(jax.tree.map(jnp.zeros_like, states[4]), None)
    assert fresh.resumed_from == 4
    np.testing.assert_array_equal(restored["w"], states[4]["w"])
    fresh.close()


@pytest.mark.timeout(120)
def test_a_corrupt_local_step_is_restored_from_its_replica(tmp_path):
    """A flipped byte in the newest local step: the step's replica is fetched over it and restored, bit for bit."""
    from openhosti_jax.checkpoint.checksums import load_records

    state = _state()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with CheckpointManager(tmp_path / "main", every_minutes=None, replicate_to=tmp_path / "copy") as ckpt:
        ckpt.maybe_save(1, state.replace(step=jnp.int32(1)), force=True)
        ckpt.wait()
        step_dir = tmp_path / "main" / "1"
        name = max(
            (n for n in load_records(step_dir)[0] if n.startswith("state/")),
            key=lambda n: (step_dir / n).stat().st_size,
        )
        data = bytearray((step_dir / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (step_dir / name).write_bytes(bytes(data))
        with pytest.warns(UserWarning, match="falling back"):
            restored, _, _ = ckpt.restore(abstract)
        assert ckpt.verify(1) == []  # the local tier holds the good copy again
    assert int(restored.step) == 1
    _assert_same(restored.params, state.params)


@pytest.mark.timeout(120)
def test_a_preemption_save_does_not_wait_for_the_replica(tmp_path, monkeypatch):
    """SIGTERM's save returns once the local tier has the step, while the copy to the replica is still held up;
    the copy lands later and close() waits for it."""
    import threading

    from openhosti_jax.checkpoint import manager as manager_module

    release, copying = threading.Event(), threading.Event()
    real = manager_module.replicate_step

    def held_up(*args, **kwargs):
        copying.set()
        assert release.wait(60)
        real(*args, **kwargs)

    monkeypatch.setattr(manager_module, "replicate_step", held_up)
    state = {"x": jnp.arange(4.0)}
    ckpt = CheckpointManager(tmp_path / "main", every_minutes=None, replicate_to=tmp_path / "copy")
    ckpt.save_on_signal()
    os.kill(os.getpid(), signal.SIGTERM)
    assert ckpt.maybe_save(5, state)  # the signal forces it and waits for the local tier only
    assert ckpt.preempted and ckpt.good_steps() == [5] and copying.wait(30) and ckpt.replica_steps() == []
    release.set()
    ckpt.close()
    assert ckpt.replica_steps() == [5] and ckpt.replication_failures == []


@pytest.mark.timeout(60)
def test_a_replica_location_that_cannot_work_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="scheme 'nosuch'"):
        CheckpointManager(tmp_path / "a", replicate_to="nosuch://bucket/run")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match="expected a location this process can write"):
        CheckpointManager(tmp_path / "b", replicate_to=tmp_path / "file" / "run")


@pytest.mark.skipif(__import__("importlib").util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_missing_object_store_client_names_the_extra(tmp_path):
    with pytest.raises(ConfigError, match=r"openhosti_jax\[gcs\]"):
        CheckpointManager(tmp_path, replicate_to="gs://bucket/run")
