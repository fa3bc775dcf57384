"""ArrayDataset: every sample once per epoch, deterministic shuffles, per-process slices, exact resume."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openhosti_jax.data import ArrayDataset, GrainIterator, StatefulIterator
from openhosti_jax.errors import BatchError

N = 23


def _data():
    x = np.arange(N, dtype=np.int64)
    return {"x": x, "y": np.stack([x * 10, x * 10 + 1], axis=1).astype(np.float32)}


def test_is_stateful_iterator():
    assert isinstance(ArrayDataset(_data(), 4, process_index=0, process_count=1), StatefulIterator)


def test_each_epoch_is_a_permutation_and_epochs_differ():
    ds = ArrayDataset(_data(), 4, seed=3, process_index=0, process_count=1)
    assert ds.steps_per_epoch == N // 4
    epochs = []
    for _ in range(3):
        seen = np.concatenate([next(ds)["x"] for _ in range(ds.steps_per_epoch)])
        assert len(set(seen.tolist())) == len(seen) == ds.steps_per_epoch * 4  # no repeats within an epoch
        epochs.append(seen)
    assert not np.array_equal(epochs[0], epochs[1])
    # the order is the seeded permutation, truncated to whole batches
    np.testing.assert_array_equal(epochs[1], np.random.default_rng([3, 1]).permutation(N)[: len(epochs[1])])


def test_rows_of_all_arrays_stay_aligned():
    ds = ArrayDataset(_data(), 5, seed=1, process_index=0, process_count=1)
    for _ in range(7):
        b = next(ds)
        np.testing.assert_array_equal(b["y"][:, 0], b["x"] * 10)
        np.testing.assert_array_equal(b["y"][:, 1], b["x"] * 10 + 1)


def test_no_shuffle_is_sequential():
    ds = ArrayDataset(_data(), 4, shuffle=False, process_index=0, process_count=1)
    np.testing.assert_array_equal(next(ds)["x"], [0, 1, 2, 3])
    np.testing.assert_array_equal(next(ds)["x"], [4, 5, 6, 7])


@pytest.mark.parametrize("count", [2, 4])
def test_process_slices_reassemble_the_single_process_batch(count):
    ref = ArrayDataset(_data(), 8, seed=5, process_index=0, process_count=1)
    parts = [ArrayDataset(_data(), 8, seed=5, process_index=p, process_count=count) for p in range(count)]
    for _ in range(6):
        want = next(ref)
        got = [next(p) for p in parts]
        assert all(g["x"].shape == (8 // count,) for g in got)
        np.testing.assert_array_equal(np.concatenate([g["x"] for g in got]), want["x"])
        np.testing.assert_array_equal(np.concatenate([g["y"] for g in got]), want["y"])


@settings(max_examples=25, deadline=None)
@given(stop=st.integers(0, 20), seed=st.integers(0, 2**31 - 1), count=st.sampled_from([1, 2]))
def test_resume_continues_at_the_same_sample(stop, seed, count):
    straight = ArrayDataset(_data(), 4, seed=seed, process_index=count - 1, process_count=count)
    batches = [next(straight)["x"] for _ in range(stop + 6)]
    first = ArrayDataset(_data(), 4, seed=seed, process_index=count - 1, process_count=count)
    for _ in range(stop):
        next(first)
    state = json.loads(json.dumps(first.get_state()))
    assert set(state) >= {"epoch", "position", "seed"}
    resumed = ArrayDataset(_data(), 4, seed=seed + 1, process_index=count - 1, process_count=count)
    resumed.set_state(state)  # its seed replaces the constructor's
    for want in batches[stop:]:
        np.testing.assert_array_equal(next(resumed)["x"], want)


def test_resume_with_another_process_count():
    one = ArrayDataset(_data(), 4, seed=2, process_index=0, process_count=1)
    for _ in range(7):
        next(one)
    halves = [ArrayDataset(_data(), 4, process_index=p, process_count=2) for p in range(2)]
    for h in halves:
        h.set_state(one.get_state())
    for _ in range(5):
        np.testing.assert_array_equal(np.concatenate([next(h)["x"] for h in halves]), next(one)["x"])


def test_num_epochs_stops():
    ds = ArrayDataset(_data(), 10, num_epochs=2, process_index=0, process_count=1)
    assert len(list(ds)) == 2 * (N // 10)


def test_defaults_to_jax_process_layout():
    ds = ArrayDataset(_data(), 4)
    assert ds.local_batch_size == 4  # one process in tests


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"arrays": {"a": np.zeros(4), "b": np.zeros(5)}, "global_batch_size": 2}, "same first-axis length"),
        ({"arrays": {}, "global_batch_size": 2}, "at least one array"),
        ({"arrays": {"a": np.zeros(8)}, "global_batch_size": 3, "process_count": 2}, "divisible"),
        ({"arrays": {"a": np.zeros(8)}, "global_batch_size": 16}, "exceeds"),
        (
            {"arrays": {"a": np.zeros(8)}, "global_batch_size": 2, "process_index": 2, "process_count": 2},
            "index",
        ),
    ],
)
def test_bad_construction_raises(kwargs, match):
    kwargs.setdefault("process_index", 0)
    kwargs.setdefault("process_count", 1)
    with pytest.raises(BatchError, match=match):
        ArrayDataset(**kwargs)


@pytest.mark.parametrize(
    "state, match",
    [
        ({"epoch": 0}, "missing"),
        ({"epoch": 0, "position": 99, "seed": 0}, "position"),
        ({"epoch": 0, "position": (1,), "seed": 0}, "changes through JSON"),
        ([0, 1], "dict"),
    ],
)
def test_bad_state_raises(state, match):
    ds = ArrayDataset(_data(), 4, process_index=0, process_count=1)
    with pytest.raises(BatchError, match=match):
        ds.set_state(state)


class _BytesStateIterator:
    """Reports its state as JSON bytes, the way grain's DataLoader iterator does."""

    def __init__(self):
        self._ds = ArrayDataset(_data(), 4, seed=9, process_index=0, process_count=1)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._ds)

    def get_state(self) -> bytes:
        return json.dumps(self._ds.get_state()).encode()

    def set_state(self, state: bytes) -> None:
        self._ds.set_state(json.loads(state.decode()))


def test_grain_adapter_turns_bytes_state_into_a_dict_and_back():
    it = GrainIterator(_BytesStateIterator())
    for _ in range(3):
        next(it)
    state = it.get_state()
    assert state == {"grain": {"epoch": 0, "position": 3, "seed": 9, "global_batch_size": 4}}
    again = GrainIterator(_BytesStateIterator())
    again.set_state(json.loads(json.dumps(state)))
    np.testing.assert_array_equal(next(again)["x"], next(it)["x"])
    with pytest.raises(BatchError, match="get_state"):
        GrainIterator([1, 2, 3])


def test_grain_adapter_on_real_grain():
    grain = pytest.importorskip("grain")
    source = grain.MapDataset.range(20).shuffle(seed=1).batch(4).to_iter_dataset()
    straight = [int(b.sum()) for b in iter(source)]
    it = GrainIterator(source)
    for _ in range(2):
        next(it)
    resumed = GrainIterator(source)
    resumed.set_state(json.loads(json.dumps(it.get_state())))
    assert [int(b.sum()) for b in resumed] == straight[2:]
