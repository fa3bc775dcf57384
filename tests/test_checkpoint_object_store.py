"""The replica tier on a real S3 endpoint: moto's server on 127.0.0.1 (a separate process speaking HTTP), reached
through the client stack users run (fsspec + s3fs + aiobotocore). A machine that lost its local disk resumes from
the bucket bit for bit; an unreachable store never stops training, and its copies catch up when it is back."""

import logging
import shutil
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # they start the S3 server as a process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server in its own process on 127.0.0.1:``port`` (in-memory: a restart empties it)."""

    def __init__(self, port: int) -> None:
        self.port, self.proc = port, None

    def start(self) -> None:
        import boto3

        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                boto3.client("s3").create_bucket(Bucket="ckpt")
                return
            except Exception:  # noqa: BLE001 - not listening yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def s3(monkeypatch):
    import s3fs

    port = _free_port()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_MAX_ATTEMPTS": "1",
    }.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    server = S3Server(port)
    server.start()
    yield server
    if server.proc.poll() is None:
        server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


def _states():
    return {s: {"w": jnp.arange(8.0) * s + 0.5, "step": jnp.asarray(s)} for s in (2, 4, 6)}


def test_a_replaced_machine_resumes_from_the_bucket(tmp_path, s3):
    from openhosti_jax.train.resume import TrainerCheckpoint

    local, url = tmp_path / "local", "s3://ckpt/run"
    ckpt = TrainerCheckpoint(local, every_minutes=None, every_steps=2, keep=2, replicate_to=url)
    for s, state in _states().items():
        assert ckpt.save(s, state, None)
        ckpt.manager.wait()  # each copied before the next save (else only the newest waiting step is copied)
    ckpt.close()
    assert ckpt.manager.replica_steps() == [4, 6]  # pruned by its own retention
    assert ckpt.manager.replication_failures == [] and len(ckpt.manager.replication_lag_s) == 3
    shutil.rmtree(local)
    fresh = TrainerCheckpoint(local, every_minutes=None, every_steps=2, keep=2, replicate_to=url)
    assert fresh.manager.fetched_step == 6 and fresh.manager.latest_good_step() == 6
    restored = fresh.restore_latest({"w": jnp.zeros(8), "step": jnp.asarray(0)}, None)
    assert fresh.resumed_from == 6
    np.testing.assert_array_equal(restored["w"], _states()[6]["w"])
    assert fresh.manager.good_steps() == [6]  # the fetched step is this machine's local tier again
    fresh.close()


def test_an_unreachable_store_never_stops_training_and_the_copies_catch_up(tmp_path, s3, caplog):
    """The store goes away after step 2: step 4 is saved locally all the same (a warning), step 6's copy catches
    up once it is back and the lag behind the local tier is logged; a machine that then loses its disk resumes
    from the bucket with step 6's state bit for bit."""
    from openhosti_jax.checkpoint import CheckpointManager

    states = _states()
    local, url = tmp_path / "local", "s3://ckpt/run"
    with CheckpointManager(local, every_minutes=None, replicate_to=url) as ckpt:
        ckpt.maybe_save(2, states[2], force=True)
        ckpt.wait()
        assert ckpt.replica_steps() == [2]
        s3.stop()  # the store goes away
        with pytest.warns(UserWarning, match="was not replicated"):
            ckpt.maybe_save(4, states[4], force=True)
            ckpt.wait()
        assert ckpt.good_steps() == [2, 4] and len(ckpt.replication_failures) == 1  # training went on
        s3.start()  # back (empty: moto keeps no state across restarts)
        with caplog.at_level(logging.WARNING, logger="openhosti_jax.checkpoint.manager"):
            ckpt.maybe_save(6, states[6], force=True)
            ckpt.wait()
        assert ckpt.replica_steps() == [6] and ckpt.replication_failures[0].startswith("step 4")
        [(step, lag)] = ckpt.replication_catch_ups
        assert step == 6 and lag >= ckpt.replication_lag_s[-1] > 0  # behind since step 4's commit
    assert any("caught up at step 6" in r.getMessage() and "lagged" in r.getMessage() for r in caplog.records)
    shutil.rmtree(local)
    with CheckpointManager(local, every_minutes=None, replicate_to=url) as fresh:
        assert fresh.fetched_step == 6
        restored, _, _ = fresh.restore({"w": jnp.zeros(8), "step": jnp.asarray(0)})
    np.testing.assert_array_equal(restored["w"], states[6]["w"])
    assert int(restored["step"]) == 6


def test_an_endpoint_that_does_not_answer_is_reported_before_training(tmp_path, s3, monkeypatch):
    import s3fs

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.errors import ConfigError

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ConfigError, match="expected a location this process can write"):
        CheckpointManager(tmp_path / "local", replicate_to="s3://ckpt/run")


def test_a_bucket_that_does_not_exist_is_refused_not_created(tmp_path, s3):
    import boto3

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.errors import ConfigError

    with pytest.raises(ConfigError, match="expected the bucket 'no-such-bucket' to exist.*aws s3 mb"):
        CheckpointManager(tmp_path / "local", replicate_to="s3://no-such-bucket/run")
    assert "no-such-bucket" not in [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]]


def test_credentials_the_bucket_refuses_are_reported_before_training(tmp_path, monkeypatch):
    """A server that checks signatures (moto with authentication on: the one bucket is made unauthenticated, then
    every request needs a key it knows): the test's made-up key is refused, and the error says so."""
    import s3fs

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.errors import ConfigError

    port = _free_port()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_MAX_ATTEMPTS": "1",
        "INITIAL_NO_AUTH_ACTION_COUNT": "1",  # read by the server process: the bucket's creation is the one free call
    }.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    server = S3Server(port)
    server.start()
    try:
        with pytest.raises(ConfigError, match="refused these credentials|InvalidAccessKeyId|Forbidden"):
            CheckpointManager(tmp_path / "local", replicate_to="s3://ckpt/run")
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
