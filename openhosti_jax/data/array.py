"""`ArrayDataset`: global batches from in-memory arrays, shuffled per epoch from a seed, resumable.

Every process computes the same permutation (from ``seed`` and the epoch number) and reads only its own
contiguous slice of each global batch: process ``p`` of ``P`` gets rows ``[p*B/P, (p+1)*B/P)`` of the global
batch. The position is counted in global batches, so a state saved with one process count resumes with another
(same global batch size), or with another global batch size when the saved sample starts a batch of the new size
(else it refuses). The last incomplete batch of an epoch is dropped, so every batch has one shape.

Example:
    >>> import numpy as np
    >>> from openhosti_jax.data import ArrayDataset
    >>> ds = ArrayDataset({"x": np.arange(10), "y": np.arange(10) * 2}, global_batch_size=4, seed=1)
    >>> first = next(ds)
    >>> first["x"].shape, ds.get_state()
    ((4,), {'epoch': 0, 'position': 1, 'seed': 1, 'global_batch_size': 4})
    >>> again = ArrayDataset({"x": np.arange(10), "y": np.arange(10) * 2}, global_batch_size=4)
    >>> again.set_state(ds.get_state())
    >>> bool(np.array_equal(next(again)["x"], next(ds)["x"]))
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from openhosti_jax.data.protocol import epoch_order, position_state
from openhosti_jax.errors import BatchError


def _process_layout(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if process_count < 1 or not 0 <= process_index < process_count:
        raise BatchError(
            f"expected 0 <= process_index < process_count, found index {process_index}, count {process_count}"
        )
    return process_index, process_count


class ArrayDataset:
    """Iterator of ``dict[str, np.ndarray]`` batches (this process's rows of each global batch).

    Args:
        arrays: equal-length arrays (first axis = samples), e.g. ``{"tokens": ..., "labels": ...}``.
        global_batch_size: samples per step over all processes; divisible by the process count.
        shuffle: permute the samples every epoch (deterministically from ``seed`` and the epoch).
        seed: the shuffling seed; saved in the state.
        num_epochs: stop after this many epochs (``None``: never stop).
        process_index, process_count: default to ``jax.process_index()`` / ``jax.process_count()``.
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: int | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> None:
        if not arrays:
            raise BatchError("ArrayDataset needs at least one array; found an empty mapping")
        self._arrays = {str(k): np.asarray(v) for k, v in arrays.items()}
        lengths = {k: (v.shape[0] if v.ndim else None) for k, v in self._arrays.items()}
        if len(set(lengths.values())) != 1 or None in lengths.values():
            raise BatchError(
                f"expected arrays with the same first-axis length (samples), found lengths {lengths}; "
                "slice them to a common number of samples"
            )
        self._n = next(iter(lengths.values()))
        self._pi, self._pc = _process_layout(process_index, process_count)
        if global_batch_size < 1 or global_batch_size % self._pc:
            raise BatchError(
                f"expected a positive global_batch_size divisible by the process count {self._pc}, "
                f"found {global_batch_size}"
            )
        if global_batch_size > self._n:
            raise BatchError(
                f"global_batch_size {global_batch_size} exceeds the {self._n} samples; lower it or add data"
            )
        if num_epochs is not None and num_epochs < 1:
            raise BatchError(f"expected num_epochs >= 1 or None, found {num_epochs}")
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // self._pc
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self._seed = int(seed)
        self._epoch = 0
        self._position = 0
        self._order: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (the incomplete last batch is dropped)."""
        return self._n // self.global_batch_size

    @property
    def num_samples(self) -> int:
        """Samples in the arrays (an epoch uses ``steps_per_epoch * global_batch_size`` of them)."""
        return self._n

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The samples at ``indices`` (any order), for readers that choose their own samples."""
        return {k: v[np.asarray(indices)] for k, v in self._arrays.items()}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch``: the same on every process and every run with this seed."""
        return epoch_order(self._seed, epoch, self._n, self.shuffle)

    def __iter__(self) -> ArrayDataset:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._position >= self.steps_per_epoch:
            self._epoch, self._position, self._order = self._epoch + 1, 0, None
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        if self._order is None:
            self._order = self.epoch_order(self._epoch)
        start = self._position * self.global_batch_size + self._pi * self.local_batch_size
        rows = self._order[start : start + self.local_batch_size]
        self._position += 1
        return {k: v[rows] for k, v in self._arrays.items()}

    def get_state(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "global_batch_size"}``: the next batch is global batch ``position`` of
        ``epoch``, in batches of ``global_batch_size``."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "global_batch_size": self.global_batch_size,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a `get_state` dict; its seed replaces this dataset's seed.

        A state saved with another global batch size resumes at the same sample when that sample starts a batch
        of this size (``position * saved_size`` divisible by ``global_batch_size``), else `BatchError`. The
        samples of the epoch that follow are the same either way; only their grouping into batches changes.
        """
        saved_size = int(state.get("global_batch_size", self.global_batch_size)) if isinstance(state, dict) else 0
        if saved_size != self.global_batch_size and isinstance(state, dict):
            if saved_size >= 1 and int(state.get("position", 0)) >= self._n // saved_size:  # the epoch was done
                state = {**state, "epoch": int(state.get("epoch", 0)) + 1, "position": 0}
            sample = int(state.get("position", 0)) * saved_size
            if saved_size < 1 or sample % self.global_batch_size:
                raise BatchError(
                    f"ArrayDataset.set_state: the state was saved with global_batch_size {saved_size} at sample "
                    f"{sample} of epoch {state.get('epoch')}, which is not the start of a batch of "
                    f"{self.global_batch_size}; resume with a global batch size dividing {sample} (e.g. "
                    f"{saved_size}), or from a checkpoint at another step"
                )
            state = {**state, "position": sample // self.global_batch_size, "global_batch_size": self.global_batch_size}
        epoch, position, seed = position_state(state, "ArrayDataset.set_state", self.steps_per_epoch)
        self._seed, self._epoch, self._position, self._order = seed, epoch, position, None
