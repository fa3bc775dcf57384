"""Nothing read from outside is trusted: planted bucket keys, crafted checksum records, symbolic links, odd folder
names and key-value store values each mark the step corrupt (restore falls back to the newest intact step, bitwise) or
raise a typed error naming the key; nothing is written outside the checkpoint directory, and no read hangs."""

import json
import os
import warnings

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openhosti_jax.checkpoint import CheckpointManager
from openhosti_jax.checkpoint.checksums import record_files, record_name
from openhosti_jax.checkpoint.replicate import fetch_step, replica_steps, replicate_step
from openhosti_jax.checkpoint.trust import KEY_ENV
from openhosti_jax.errors import CheckpointCorruptError, DistributedError


def _state(step: int) -> dict:
    return {"w": jnp.arange(64, dtype=jnp.float32) * step, "step": jnp.int32(step)}


def _abstract():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))


def _save(directory, steps=(2, 4), **kw) -> None:
    with CheckpointManager(directory, every_minutes=None, **kw) as ckpt:
        for s in steps:
            ckpt.maybe_save(s, _state(s), force=True)


def _restores(directory, step: int, match: str, **kw) -> None:
    """Restore falls back to ``step`` with a warning matching ``match``, and the state is ``step``'s bit for bit."""
    with CheckpointManager(directory, every_minutes=None, **kw) as ckpt:
        with pytest.warns(UserWarning, match=match):
            restored, _, _ = ckpt.restore(_abstract())
        assert ckpt.restored_step == step
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(_state(step)["w"]))


def _edit_record(step_dir, edit) -> None:
    (path,) = record_files(step_dir)
    body = json.loads(path.read_text())
    edit(body)
    path.write_text(json.dumps(body))


def _first(files, prefix):
    return next(k for k in sorted(files) if k.startswith(prefix))


CRAFTED = {
    "dot-dot to /dev/zero": lambda b: b["files"].update({"meta/../../dev/zero": [10**12, 0]}),
    "absolute path": lambda b: b["files"].update({"/etc/hostname": [5, 0]}),
    "size as a string": lambda b: b["files"].update({_first(b["files"], "state/"): ["8", 0]}),
    "empty entry": lambda b: b["files"].update({_first(b["files"], "state/"): []}),
    "unknown algorithm": lambda b: b.update(algorithm="md5"),
    "files not an object": lambda b: b.update(files=[1, 2]),
    "outside the items": lambda b: b["files"].update({"other/x": [1, 0]}),
}


@pytest.mark.timeout(30)  # a record that made restore read /dev/zero used to hang here
@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_checksum_record_marks_its_step_corrupt_and_restore_falls_back(tmp_path, case):
    _save(tmp_path)
    _edit_record(tmp_path / "4", CRAFTED[case])
    _restores(tmp_path, 2, match="checkpoint step 4 .*checksum record")


def test_a_meta_file_the_record_does_not_list_is_refused(tmp_path):
    _save(tmp_path)
    (tmp_path / "4" / "meta" / "planted").write_text("{}")
    _restores(tmp_path, 2, match="file meta/planted was not part of the committed step")


def test_a_symlink_in_a_step_is_never_followed_on_restore_or_upload(tmp_path):
    _save(tmp_path / "ckpt")
    step = tmp_path / "ckpt" / "4"
    (victim,) = [p for p in (step / "state" / "w").iterdir() if not p.name.startswith(".")]
    outside = tmp_path / "outside"
    outside.write_bytes(victim.read_bytes())  # the same bytes: only the link gives it away
    victim.unlink()
    victim.symlink_to(outside)
    _restores(tmp_path / "ckpt", 2, match="symbolic link")
    with pytest.raises(CheckpointCorruptError, match="symbolic links"):
        replicate_step(step, tmp_path / "replica", keep=None)
    assert not (tmp_path / "replica" / "4").exists()


def test_step_folders_are_ascii_digits_only(tmp_path):
    _save(tmp_path / "ckpt")
    _save(tmp_path / "replica")
    for odd in ("²", "012", "-1", "٣"):
        (tmp_path / "ckpt" / odd).mkdir()
        (tmp_path / "replica" / odd).mkdir()
    assert replica_steps(tmp_path / "replica") == [2, 4]
    with CheckpointManager(tmp_path / "ckpt", every_minutes=None, keep=2) as ckpt:
        assert ckpt.good_steps() == [2, 4]
        ckpt.maybe_save(6, _state(6), force=True)  # rotation meets the odd folders
        ckpt.wait()
        assert ckpt.good_steps() == [4, 6]
    assert {"²", "012", "-1", "٣"} <= set(os.listdir(tmp_path / "ckpt"))  # not ours: left alone


def test_a_planted_bucket_key_with_dot_dots_writes_nothing_outside_and_the_step_is_skipped(tmp_path):
    url = f"memory://bucket-{os.getpid()}-{id(tmp_path)}/run"
    _save(tmp_path / "first", replicate_to=url)
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/4/../../../escaped", b"planted")  # the literal key, as an object store keeps it
    assert replica_steps(url) == [2, 4]  # still listed: the check is where the keys are used
    fresh = tmp_path / "fresh" / "ckpt"
    with pytest.raises(CheckpointCorruptError, match=r"the key '.*/4/\.\./\.\./\.\./escaped'.*'\.\.' part"):
        fetch_step(url, 4, fresh)
    assert sorted(p.name for p in tmp_path.rglob("escaped")) == []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with CheckpointManager(fresh, every_minutes=None, replicate_to=url) as ckpt:
            restored, _, _ = ckpt.restore(_abstract())
            assert ckpt.restored_step == 2
    assert any("could not fetch checkpoint step 4" in str(w.message) and "escaped" in str(w.message) for w in said)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(_state(2)["w"]))
    assert not any(n.startswith("4.fetching") for n in os.listdir(fresh))  # the fetch folder went too
    fs.rm(root.split("/")[0], recursive=True)


def test_with_a_key_a_record_rewritten_to_match_tampered_data_is_caught(tmp_path, monkeypatch):
    import zlib

    def tamper(directory):  # change a chunk and rewrite its CRC and size in the record, as an attacker could
        step = directory / "4"
        (chunk,) = [p for p in (step / "state" / "w").iterdir() if not p.name.startswith(".")]
        data = bytearray(chunk.read_bytes())
        data[-1] ^= 0xFF
        chunk.write_bytes(bytes(data))
        rel = chunk.relative_to(step).as_posix()

        def edit(body):
            body["algorithm"] = "crc32"
            body["files"][rel] = [len(data), zlib.crc32(bytes(data))]
            for other in body["files"]:
                if other != rel:
                    body["files"][other] = [(step / other).stat().st_size, zlib.crc32((step / other).read_bytes())]

        _edit_record(step, edit)

    _save(tmp_path / "plain")
    tamper(tmp_path / "plain")
    with CheckpointManager(tmp_path / "plain", every_minutes=None) as ckpt:
        ckpt.restore(_abstract())
        assert ckpt.restored_step == 4  # without a key the CRCs catch accidents, not this
    monkeypatch.setenv(KEY_ENV, "a secret")
    _save(tmp_path / "keyed")
    assert "hmac" in json.loads((tmp_path / "keyed" / "4" / record_name(0, 1)).read_text())
    tamper(tmp_path / "keyed")
    _restores(tmp_path / "keyed", 2, match="HMAC-SHA256 does not match")
    with CheckpointManager(tmp_path / "plain", every_minutes=None) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a key set: unsigned records are not trusted, so no step of it is
        with pytest.raises(CheckpointCorruptError, match="has no HMAC-SHA256"):
            ckpt.restore(_abstract())


class _FakeStore:
    """The coordinator's key-value client, with whatever someone else wrote under the same directory."""

    def __init__(self, planted):
        self.data, self.planted = {}, planted

    def key_value_set(self, key, value):
        self.data[key] = value

    def key_value_dir_get(self, directory):
        got = [(k, v) for k, v in self.data.items() if k.startswith(directory)]
        return got + [(directory + k if k is not None else "x", v) for k, v in self.planted]


@pytest.mark.parametrize(
    "planted, needle",
    [
        ([("one", "1")], "the key '.*one'"),
        ([("7", "1")], "the key '.*7'"),
        ([("1", None)], "the value None"),
        ([("1", "{not json")], "process 1's value .* to be JSON"),
        ([("²", "1")], "the key '.*²'"),
    ],
)
def test_values_read_from_the_key_value_store_are_checked(monkeypatch, planted, needle):
    from openhosti_jax.mesh import barrier

    monkeypatch.setattr(barrier, "_client", lambda: _FakeStore(planted))
    monkeypatch.setattr(barrier.jax, "process_count", lambda: 2)
    monkeypatch.setattr(barrier.jax, "process_index", lambda: 0)
    with pytest.raises(DistributedError, match=needle):
        barrier.gathered("probe", 1, timeout_s=1)


def test_a_bad_heartbeat_setting_is_a_typed_error(monkeypatch):
    from openhosti_jax.mesh import initialize_distributed

    monkeypatch.setenv("OPENHOSTI_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("OPENHOSTI_NUM_PROCESSES", "2")
    monkeypatch.setenv("OPENHOSTI_PROCESS_ID", "1")
    for bad in ("abc", "0", "-5"):
        monkeypatch.setenv("OPENHOSTI_HEARTBEAT_TIMEOUT_S", bad)
        with pytest.raises(DistributedError, match="OPENHOSTI_HEARTBEAT_TIMEOUT_S"):
            initialize_distributed()


def test_reading_a_recorded_file_stops_just_past_its_recorded_size(tmp_path):
    from openhosti_jax.checkpoint import checksums

    step = tmp_path / "4"
    (step / "state" / "w").mkdir(parents=True)
    (step / "state" / "w" / "0").write_bytes(b"x" * (8 << 20))
    read = []
    real = checksums._extender

    def counting(algorithm):
        extend = real(algorithm)
        return lambda crc, chunk: (read.append(len(chunk)), extend(crc, chunk))[1]

    checksums._extender = counting
    try:
        problems = checksums.verify_checksums(step, record={"state/w/0": [3, 0, "crc32"]})
    finally:
        checksums._extender = real
    assert sum(read) == 4 and problems == [
        "array 'w': file state/w/0 has more than 3 bytes, 3 were written (truncated?)"
    ]
