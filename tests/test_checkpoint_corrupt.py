"""Damaged checkpoint files: every flipped byte, truncation and deletion is found and named; restore falls back."""

import pathlib
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from openhosti_jax.checkpoint import CheckpointManager
from openhosti_jax.checkpoint.checksums import record_files
from openhosti_jax.errors import CheckpointCorruptError


def _state(step: int) -> dict:
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    rs = np.random.default_rng(step)
    sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
    return {
        "params": {
            "w": jax.device_put(jnp.asarray(rs.normal(size=(16, 4)), jnp.float32), sharded),
            "b": jnp.asarray(rs.normal(size=(3,)), jnp.float32),
        },
        "count": jnp.int32(step),
        "rng": jax.random.key(step),
    }


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            return False
    return True


@pytest.fixture
def two_steps(tmp_path):
    with CheckpointManager(tmp_path, every_minutes=None) as ckpt:
        for s in (1, 2):
            ckpt.maybe_save(s, _state(s), force=True)
    return tmp_path


def _damage(path: pathlib.Path, mode: str, rs: np.random.Generator) -> None:
    data = path.read_bytes()
    if mode == "flip":
        b = bytearray(data)
        b[rs.integers(len(b))] ^= 1 << int(rs.integers(8))
        path.write_bytes(bytes(b))
    elif mode == "truncate":
        path.write_bytes(data[: rs.integers(len(data))])
    else:
        path.unlink()


def _expected_name(rel: pathlib.Path) -> str:
    parts = rel.parts
    is_array = parts[0] == "state" and len(parts) > 2 and parts[1] != "array_metadatas"
    return f"array '{parts[1]}'" if is_array else f"file '{rel.as_posix()}'"


@pytest.mark.timeout(180)
def test_every_damage_to_every_file_is_detected_and_named(two_steps):
    rs = np.random.default_rng(0)
    step_dir = two_steps / "2"
    files = sorted(
        p for p in step_dir.rglob("*") if p.is_file() and p.relative_to(step_dir).parts[0] in ("state", "data", "meta")
    )
    arrays = {p.relative_to(step_dir).parts[1] for p in files if p.relative_to(step_dir).parts[0] == "state"}
    assert {"params.w", "params.b", "count", "rng"} <= arrays
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:
        assert ckpt.verify(2) == []
        checked = 0
        for path in files:
            original = path.read_bytes()
            for mode in ("flip", "truncate", "delete"):
                if mode == "truncate" and not original:
                    continue
                for _ in range(2 if mode == "flip" else 1):
                    _damage(path, mode, rs)
                    problems = ckpt.verify(2)
                    path.write_bytes(original)
                    assert len(problems) == 1, (path, mode, problems)
                    assert problems[0].startswith(_expected_name(path.relative_to(step_dir))), problems
                    checked += 1
            assert ckpt.verify(2) == []
    assert checked >= 3 * len(files) - 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["flip", "truncate", "delete"])
def test_restore_falls_back_to_the_previous_step_with_a_warning(two_steps, mode):
    chunk = sorted((two_steps / "2" / "state" / "params.w").glob("[0-9]*"))[3]
    _damage(chunk, mode, np.random.default_rng(1))
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:
        assert ckpt.latest_good_step() == 2  # committed; corruption is found when it is read
        with pytest.warns(UserWarning, match=r"step 2 .*array 'params\.w'.*falling back"):
            restored, _, _ = ckpt.restore(_abstract(_state(1)))
    assert _equal(restored, _state(1))


@pytest.mark.timeout(120)
def test_all_steps_corrupt_raises_naming_each_array(two_steps):
    _damage(two_steps / "1" / "state" / "params.b" / "0", "flip", np.random.default_rng(2))
    _damage(sorted((two_steps / "2" / "state" / "params.w").glob("[0-9]*"))[0], "delete", np.random.default_rng(3))
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointCorruptError, match=r"(?s)step 2 .*'params\.w'.*step 1 .*'params\.b'"):
                ckpt.restore(_abstract(_state(1)))
        with pytest.raises(CheckpointCorruptError, match=r"params\.w.*is missing"):
            ckpt.restore(_abstract(_state(1)), step=2)  # an explicit step does not fall back


@pytest.mark.timeout(120)
def test_a_step_without_its_checksum_record_is_not_good(two_steps):
    (record,) = record_files(two_steps / "2")  # one process: one record
    record.unlink()
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:
        assert ckpt.good_steps() == [1]
        restored, _, _ = ckpt.restore(_abstract(_state(1)))
        assert _equal(restored, _state(1))
        assert ckpt.maybe_save(2, _state(2), force=True)  # the unverified step is replaced
        ckpt.wait()
        assert ckpt.good_steps() == [1, 2] and ckpt.verify(2) == []
    shutil.rmtree(two_steps)


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_each_record_verifies_with_the_algorithm_it_names(tmp_path, monkeypatch, algorithm):
    import zlib

    import google_crc32c

    from openhosti_jax.checkpoint import checksums

    monkeypatch.setattr(checksums, "ALGORITHM", algorithm)
    step = tmp_path / "7"
    (step / "state" / "w").mkdir(parents=True)
    payload = bytes(range(256)) * 4096
    (step / "state" / "w" / "0").write_bytes(payload)
    record = checksums.record_checksums(step)
    expected = zlib.crc32(payload) if algorithm == "crc32" else google_crc32c.value(payload)
    assert record == {"state/w/0": [len(payload), expected]}
    monkeypatch.setattr(checksums, "ALGORITHM", "crc32c" if algorithm == "crc32" else "crc32")  # a newer writer
    assert checksums.verify_checksums(step) == []
    (step / "state" / "w" / "0").write_bytes(payload[:-1] + b"\x00")
    (problem,) = checksums.verify_checksums(step)
    assert f"has checksum {algorithm}" in problem and "array 'w'" in problem
