"""A state that no longer fits its checkpoint (shape, dtype, added / removed / renamed leaf) is a mismatch, not
corruption: one CheckpointMismatchError naming every differing path, no fallback, no warning per step."""

import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from openhosti_jax.checkpoint import CheckpointManager, checksums
from openhosti_jax.checkpoint.checksums import LEGACY_RECORD, record_checksums, record_files
from openhosti_jax.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError


def _state(step: int) -> dict:
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    rs = np.random.default_rng(step)
    return {
        "params": {
            "w": jax.device_put(
                jnp.asarray(rs.normal(size=(16, 4)), jnp.float32), NamedSharding(mesh, PartitionSpec("fsdp"))
            ),
            "b": jnp.asarray(rs.normal(size=(3,)), jnp.float32),
        },
        "count": jnp.int32(step),
        "rng": jax.random.key(step),
    }


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _host(x):
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


@pytest.fixture
def two_steps(tmp_path):
    with CheckpointManager(tmp_path, every_minutes=None) as ckpt:
        for s in (1, 2):
            ckpt.maybe_save(s, _state(s), force=True)
    return tmp_path


def _mismatch(directory, abstract, **kwargs) -> str:
    """The CheckpointMismatchError message of restoring ``abstract``; fails on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a corrupt-step warning would be an exception here
        with CheckpointManager(directory, every_minutes=None) as ckpt:
            with pytest.raises(CheckpointMismatchError) as info:
                ckpt.restore(abstract, **kwargs)
            assert ckpt.restored_step is None
    message = str(info.value)
    assert "corrupt" not in message and "checksum" not in message
    return message


def _edited(**params):
    """A fresh state with edited params: a value replaces or adds a leaf, ``None`` removes one."""
    state = _state(0)
    merged = {**state["params"], **params}
    state["params"] = {k: v for k, v in merged.items() if v is not None}
    return state


@pytest.mark.timeout(120)
def test_changed_shape_names_the_path_and_both_shapes(two_steps):
    bigger = jnp.zeros((16, 8), jnp.float32)
    message = _mismatch(two_steps, _abstract(_edited(w=bigger)))
    assert "params.w: saved float32[16,4], wanted float32[16,8]" in message
    assert "older good steps [1] do not match either" in message and "step 2" in message
    assert "params.b" not in message  # only the differing leaves


@pytest.mark.timeout(120)
def test_changed_dtype_and_key_ness(two_steps):
    abstract = _abstract(_edited(b=jnp.zeros(3, jnp.bfloat16)))
    abstract["rng"] = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=abstract["count"].sharding)
    message = _mismatch(two_steps, abstract)
    assert "params.b: saved float32[3], wanted bfloat16[3]" in message
    assert "rng: saved uint32[2] (typed PRNG key data), wanted uint32[2]" in message


@pytest.mark.timeout(120)
def test_added_leaf_then_partial_restore_keeps_its_value(two_steps):
    fresh = _edited(extra=jnp.full((5,), 7.0))
    message = _mismatch(two_steps, _abstract(fresh))
    assert "added (in the state being restored, not in the checkpoint): ['params.extra']" in message
    assert "partial=True" in message
    shapes_only = _mismatch(two_steps, _abstract(fresh), partial=True)
    assert "['params.extra']" in shapes_only and "found only shapes" in shapes_only
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:
        restored, _, _ = ckpt.restore(fresh, partial=True)
        assert ckpt.restored_step == 2
    np.testing.assert_array_equal(restored["params"]["extra"], np.full(5, 7.0, np.float32))
    saved = _state(2)
    for path in (("params", "w"), ("params", "b"), ("count",), ("rng",)):
        a, b = restored, saved
        for k in path:
            a, b = a[k], b[k]
        np.testing.assert_array_equal(_host(a), _host(b))
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    assert restored["params"]["w"].sharding == saved["params"]["w"].sharding


@pytest.mark.timeout(120)
def test_removed_leaf_then_partial_restore_reads_the_rest(two_steps):
    abstract = _abstract(_edited(b=None))
    message = _mismatch(two_steps, abstract)
    assert "missing (in the checkpoint, not in the state being restored): ['params.b']" in message
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:
        restored, _, _ = ckpt.restore(abstract, partial=True)
    assert set(restored["params"]) == {"w"}
    np.testing.assert_array_equal(restored["params"]["w"], _state(2)["params"]["w"])


@pytest.mark.timeout(120)
def test_renamed_leaf_is_named_on_both_sides(two_steps):
    state = _edited(b=None, bias=jnp.zeros(3, jnp.float32))
    message = _mismatch(two_steps, _abstract(state))
    assert "['params.bias']" in message and "['params.b']" in message
    assert "renamed? params.b -> params.bias" in message


@pytest.mark.timeout(120)
def test_a_mismatch_is_found_before_checksums_even_on_a_damaged_step(two_steps):
    chunk = sorted((two_steps / "2" / "state" / "params.w").glob("[0-9]*"))[0]
    chunk.write_bytes(b"\0" * len(chunk.read_bytes()))
    message = _mismatch(two_steps, _abstract(_edited(w=jnp.zeros((8, 4)))))
    assert "params.w: saved float32[16,4], wanted float32[8,4]" in message
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:  # with the right model: corruption, fallback
        with pytest.warns(UserWarning, match=r"step 2 .*array 'params\.w'.*falling back"):
            ckpt.restore(_abstract(_state(0)))
        assert ckpt.restored_step == 1
        with pytest.raises(CheckpointCorruptError, match=r"params\.w.*has checksum"):
            ckpt.restore(_abstract(_state(0)), step=2)


@pytest.mark.timeout(120)
def test_an_older_step_that_matches_is_offered(two_steps):
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:  # a newer step written by an edited model
        ckpt.maybe_save(3, _edited(extra=jnp.ones(2)), force=True)
    message = _mismatch(two_steps, _abstract(_state(0)))
    assert "step 3" in message and "missing" in message and "['params.extra']" in message
    assert "older good steps [1, 2] match: restore(..., step=2)" in message


@pytest.mark.timeout(120)
def test_a_checkpoint_from_before_recorded_shapes_still_reports_a_mismatch(two_steps, monkeypatch):
    step_dir = two_steps / "2"
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["openhosti"]["shapes"]
    meta_file.write_text(json.dumps(meta))
    for path in record_files(step_dir):
        path.unlink()
    monkeypatch.setattr(checksums, "ALGORITHM", "crc32")  # what records were before they named their algorithm
    files = record_checksums(step_dir)
    for path in record_files(step_dir):
        path.unlink()
    (step_dir / LEGACY_RECORD).write_text(json.dumps({"version": 1, "files": files}))
    message = _mismatch(two_steps, _abstract(_edited(b=jnp.zeros(4))))
    assert "step 2" in message and "params.b: saved float32[3], wanted float32[4]" in message
    with CheckpointManager(two_steps, every_minutes=None) as ckpt:
        assert ckpt.good_steps() == [1, 2] and ckpt.verify(2) == []
        restored, _, _ = ckpt.restore(_abstract(_state(0)))
        assert ckpt.restored_step == 2
    np.testing.assert_array_equal(restored["params"]["b"], _state(2)["params"]["b"])


@pytest.mark.timeout(60)
def test_no_directory_or_no_step_is_a_plain_checkpoint_error(tmp_path):
    abstract = _abstract(_state(0))
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory, every_minutes=None) as ckpt:
        with pytest.raises(CheckpointError, match="has no step folders") as empty:
            ckpt.restore(abstract)
        (directory / "5").mkdir()  # a save that never finished
        with pytest.raises(CheckpointError, match=r"step folders \[5\] but none has all its checksum records"):
            ckpt.restore(abstract)
        shutil.rmtree(directory)
        with pytest.raises(CheckpointError, match=f"{directory} does not exist") as missing:
            ckpt.restore(abstract)
        with pytest.raises(CheckpointError, match=r"expected checkpoint step 4 in .*found no such folder"):
            ckpt.restore(abstract, step=4)
    assert type(empty.value) is CheckpointError and type(missing.value) is CheckpointError
    assert str(directory) in str(empty.value)
