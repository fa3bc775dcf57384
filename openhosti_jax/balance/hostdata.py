"""Host-local data for the balanced step: each process reads only the samples its own devices will run.

`HostLocalData` walks an indexed data source (an `openhosti_jax.data.ArrayDataset`, a mapping of equal-length
arrays, a torch map-style ``Dataset``, a grain ``MapDataset``: anything with ``len()`` and integer indexing) in a
per-epoch order that every process computes alike from ``seed``. Global batch ``k`` of an epoch is the samples
``order[k*B : (k+1)*B]``, cut into ``microbatches`` consecutive pieces. Each `HostLocalBatch` is lazy: the
balanced step places it for the current counts (`HostLocalBatch.place`), and a process then reads only the
microbatches assigned to its addressable devices. When the balancer moves counts, whole sample index ranges
move between hosts; samples are never shipped. The position (``epoch``, ``position``, ``seed``) does not depend
on the assignment, so a run restarted with other counts continues at exactly the next sample.

Example:
    >>> import numpy as np
    >>> from openhosti_jax.balance import HostLocalData
    >>> data = HostLocalData({"x": np.arange(12.0)}, global_batch_size=4, microbatches=2, shuffle=False)
    >>> batch = next(data)
    >>> batch.sample_ids.tolist(), data.get_state()["position"]
    ([[0, 1], [2, 3]], 1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from openhosti_jax.balance.buffer import Axes, place_microbatches
from openhosti_jax.data.protocol import epoch_order, position_state
from openhosti_jax.errors import BatchError

_NOT_INDEXED = ("IterableDataset", "IterDataset", "generator")


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


class _Reader:
    """``read(ids) -> pytree of arrays [len(ids), ...]`` over an indexed source, counting what it reads."""

    def __init__(self, source: Any):
        kind = type(source).__name__
        if isinstance(source, Mapping):
            arrays = {str(k): np.asarray(v) for k, v in source.items()}
            lengths = {len(v) if v.ndim else None for v in arrays.values()}
            if len(lengths) != 1 or None in lengths:
                raise BatchError(f"expected equal-length arrays, found lengths {sorted(map(str, lengths))}")
            self.n, self._rows = lengths.pop(), lambda ids: {k: v[ids] for k, v in arrays.items()}
        elif callable(getattr(source, "rows", None)) and hasattr(source, "num_samples"):  # ArrayDataset
            self.n, self._rows = int(source.num_samples), source.rows
        elif (
            hasattr(source, "__len__")
            and hasattr(source, "__getitem__")
            and iter(source) is not source
            and not any(c.__name__ in _NOT_INDEXED for c in type(source).__mro__)
        ):
            self.n = len(source)
            self._rows = lambda ids: jax.tree.map(
                lambda *xs: np.stack([_to_numpy(x) for x in xs]), *[source[int(i)] for i in ids]
            )
        else:
            raise BatchError(
                f"host-local balancing reads samples by index, and a {kind} cannot be indexed (it needs len() and "
                "source[i]); pass an ArrayDataset, a dict of arrays, a torch map-style Dataset or a grain "
                "MapDataset, or balance without host-local data"
            )
        if self.n < 1:
            raise BatchError(f"the data source has no samples (len {self.n})")
        self.bytes_read = 0
        self.ids_read: list[int] | None = None  # a list when recording

    def read(self, ids: np.ndarray) -> Any:
        out = self._rows(np.asarray(ids, np.int64))
        self.bytes_read += sum(np.asarray(x).nbytes for x in jax.tree.leaves(out))
        if self.ids_read is not None:
            self.ids_read.extend(int(i) for i in ids)
        return out


class _LazyLeaf:
    """One leaf of a `HostLocalBatch`: ``[microbatches, rows, ...]``, read on indexing."""

    def __init__(self, batch: HostLocalBatch, where: int, shape: tuple[int, ...], dtype: np.dtype):
        self._batch, self._where, self.shape, self.dtype = batch, where, shape, dtype
        self.ndim = len(shape)

    def __getitem__(self, key: Any) -> np.ndarray:
        mbs = np.arange(self.shape[0])[key]
        if mbs.size == 0:
            return np.zeros((0, *self.shape[1:]), self.dtype)
        return np.stack([jax.tree.leaves(self._batch.microbatch(int(k)))[self._where] for k in np.ravel(mbs)])


class HostLocalBatch:
    """One global batch, read lazily: `place` reads only this process's microbatches."""

    def __init__(self, reader: _Reader, sample_ids: np.ndarray, example: Any):
        self._reader = reader
        self.sample_ids = sample_ids
        """``[microbatches, rows]``: the source index of every sample of the batch, in the global order."""
        self.microbatches = sample_ids.shape[0]
        self.global_batch_size = sample_ids.size
        self._cache: dict[int, Any] = {}
        leaves, self._treedef = jax.tree.flatten(example)
        self._lazy = jax.tree.unflatten(
            self._treedef,
            [_LazyLeaf(self, i, (*sample_ids.shape, *np.shape(x)), np.asarray(x).dtype) for i, x in enumerate(leaves)],
        )

    def microbatch(self, k: int) -> Any:
        """Microbatch ``k`` (read from the source the first time it is asked for)."""
        if k not in self._cache:
            self._cache[k] = self._reader.read(self.sample_ids[k])
        return self._cache[k]

    def place(self, counts: Sequence[int], slots: int, mesh: Mesh, axis: Axes = "data") -> Any:
        """The balanced step's buffer for ``counts`` (`place_microbatches`); reads this process's samples only."""
        return place_microbatches(self._lazy, counts, slots, mesh, axis)

    @property
    def read_ids(self) -> np.ndarray:
        """The sample ids this process has read for this batch."""
        return np.concatenate([self.sample_ids[k] for k in sorted(self._cache)] or [np.zeros(0, np.int64)])


class HostLocalData:
    """Iterator of `HostLocalBatch` es over an indexed source; resumable (`get_state` / `set_state`).

    Args:
        source: an indexed data source (see the module doc); a one-shot iterator or an iterable-style dataset
            raises `BatchError`.
        global_batch_size: samples per step over all processes; divisible by ``microbatches``.
        microbatches: pieces each global batch is cut into (the balanced step's ``microbatches``).
        shuffle, seed: a new permutation per epoch from ``seed`` and the epoch number (the same on every process).
        num_epochs: stop after this many epochs (``None``: never stop).
        record_ids: keep every sample id this process reads in `ids_read` (for checks; it grows with the run).
    """

    def __init__(
        self,
        source: Any,
        global_batch_size: int,
        *,
        microbatches: int,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: int | None = None,
        record_ids: bool = False,
    ) -> None:
        self._reader = _Reader(source)
        self._reader.ids_read = [] if record_ids else None
        n = self._reader.n
        bad = [
            f"{k}={v!r}"
            for k, v in (("global_batch_size", global_batch_size), ("microbatches", microbatches))
            if isinstance(v, bool) or not isinstance(v, int) or v < 1
        ]
        if bad or global_batch_size % microbatches or global_batch_size > n:
            raise BatchError(
                f"expected ints global_batch_size >= 1 divisible by microbatches >= 1 and at most the {n} samples, "
                f"found global_batch_size={global_batch_size!r}, microbatches={microbatches!r}"
            )
        self.global_batch_size, self.microbatches = global_batch_size, microbatches
        self.shuffle, self.num_epochs = shuffle, num_epochs
        self._seed, self._epoch, self._position = int(seed), 0, 0
        self._order: np.ndarray | None = None
        example = self._reader._rows(np.zeros(1, np.int64))  # the sample structure (not counted as read)
        self._example = jax.tree.map(lambda x: np.asarray(x)[0], example)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (the incomplete last batch is dropped)."""
        return self._reader.n // self.global_batch_size

    @property
    def bytes_read(self) -> int:
        """Bytes this process has read from the source so far."""
        return self._reader.bytes_read

    @property
    def ids_read(self) -> list[int]:
        """Every sample id this process has read, in reading order (``record_ids=True``)."""
        if self._reader.ids_read is None:
            raise BatchError("HostLocalData records the ids it reads only with record_ids=True")
        return self._reader.ids_read

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (the same on every process and every run with this seed)."""
        return epoch_order(self._seed, epoch, self._reader.n, self.shuffle)

    def __iter__(self) -> HostLocalData:
        return self

    def __next__(self) -> HostLocalBatch:
        if self._position >= self.steps_per_epoch:
            self._epoch, self._position, self._order = self._epoch + 1, 0, None
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        if self._order is None:
            self._order = self.epoch_order(self._epoch)
        b = self.global_batch_size
        ids = self._order[self._position * b : (self._position + 1) * b].reshape(self.microbatches, -1)
        self._position += 1
        return HostLocalBatch(self._reader, ids, self._example)

    def get_state(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "global_batch_size"}``: independent of the balancer's assignment."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "global_batch_size": self.global_batch_size,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a `get_state` dict (saved with the same global batch size)."""
        if not isinstance(state, dict) or int(state.get("global_batch_size", -1)) != self.global_batch_size:
            raise BatchError(
                f"HostLocalData.set_state: expected a state saved with global_batch_size {self.global_batch_size}, "
                f"found {state!r}; resume with the global batch size the run was saved with"
            )
        epoch, position, seed = position_state(state, "HostLocalData.set_state", self.steps_per_epoch)
        self._seed, self._epoch, self._position, self._order = seed, epoch, position, None
