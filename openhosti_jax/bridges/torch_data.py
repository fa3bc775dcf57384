"""`TorchLoader`: a torch ``DataLoader`` as a resumable iterator of numpy (or sharded global) batches.

It yields ``dict[str, np.ndarray]`` batches like the native `openhosti_jax.data.ArrayDataset` (or, given a
mesh, ``dict[str, jax.Array]`` global batches through `openhosti_jax.sharding.place_batch`) and reports the same
JSON position
``{"epoch", "position", "seed"}``: ``position`` batches of ``epoch`` were consumed.

Each epoch's order must be reproducible for a resume to land on the same sample. Before each epoch the adapter
reseeds the loader's ``torch.Generator`` (and any sampler's own generator) from ``(seed, epoch)`` and calls
``set_epoch(epoch)`` on samplers that have it (``DistributedSampler``). A shuffling ``RandomSampler`` without
a generator draws from torch's global RNG and is refused.

A plain single-process loader (map-style dataset, ``num_workers=0``, no pinned memory) is driven directly: the
adapter draws each batch's indices from the loader's sampler and fetches them from its dataset through its
``collate_fn``, exactly as the DataLoader's own single-process iterator does, without that iterator's per-batch
profiler scope and bookkeeping (~15% of a fast batch here). On resume it then skips the first ``position``
index batches without loading them; any other loader loads them again and drops them.

`PermutationBatchSampler` draws a whole batch of shuffled indices as one tensor slice (``BatchSampler`` over a
``RandomSampler`` yields every index as a Python int: ~10-20 us per 256-row batch).

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> ds = TensorDataset(torch.arange(8.0), torch.arange(8))
    >>> dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator())
    >>> it = TorchLoader(dl, names=("x", "y"), seed=0)
    >>> b = next(it)
    >>> sorted(b), b["x"].shape, it.get_state()
    (['x', 'y'], (4,), {'epoch': 0, 'position': 1, 'seed': 0})
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from openhosti_jax.bridges.epochs import EpochIterator
from openhosti_jax.bridges.tensors import torch_to_numpy
from openhosti_jax.errors import BatchError, BridgeError
from openhosti_jax.sharding.batch import BatchSpec


def epoch_seed(seed: int, epoch: int) -> int:
    """A well-mixed 63-bit seed for ``epoch`` of a run seeded with ``seed``."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _samplers(loader: Any) -> list[Any]:
    """Every sampler object the loader draws indices through (outermost first)."""
    found, todo = [], [getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)]
    while todo:
        s = todo.pop()
        if s is not None and all(s is not f for f in found):
            found.append(s)
            todo.append(getattr(s, "sampler", None))
    return found


def _generators(loader: Any) -> list[Any]:
    """The distinct torch generators behind the loader's shuffling; refuses unseeded random samplers."""
    import torch
    from torch.utils.data import RandomSampler

    gens = [] if loader.generator is None else [loader.generator]
    for s in _samplers(loader):
        gen = getattr(s, "generator", None)
        if isinstance(s, (RandomSampler, PermutationBatchSampler)) and gen is None:
            raise BridgeError(
                f"TorchLoader: expected reproducible shuffling, found a {type(s).__name__} without a generator "
                "(it draws from torch's global RNG, so a resumed run would see another order); pass "
                "DataLoader(..., shuffle=True, generator=torch.Generator()) or use a DistributedSampler"
            )
        if isinstance(gen, torch.Generator) and all(gen is not g for g in gens):
            gens.append(gen)
    return gens


def _direct(loader: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """(index sampler, fetch) of a plain single-process map-style loader, the DataLoader's own single-process
    pipeline; None for loaders that need its iterator (workers, pinned memory, iterable datasets)."""
    import torch.utils.data as tud

    dataset = loader.dataset
    pipes = tuple(t for t in (getattr(tud, "IterDataPipe", None), getattr(tud, "MapDataPipe", None)) if t)
    if loader.num_workers or loader.pin_memory or isinstance(dataset, (tud.IterableDataset, *pipes)):
        return None
    collate = loader.collate_fn
    if loader.batch_sampler is None:  # batch_size=None: each index (often a batch of them) fetched at once
        return loader.sampler, lambda index: collate(dataset[index])
    many = getattr(dataset, "__getitems__", None)
    if many:
        return loader.batch_sampler, lambda rows: collate(many(rows))
    return loader.batch_sampler, lambda rows: collate([dataset[i] for i in rows])


class PermutationBatchSampler:
    """Batches of indices ``0 .. n-1`` as int64 tensors, a fresh permutation per epoch (a ``DataLoader`` sampler).

    Use it as ``DataLoader(dataset, sampler=PermutationBatchSampler(...), batch_size=None)`` with a dataset whose
    ``__getitem__`` takes an index tensor (e.g. ``index_select``); `TorchLoader` reseeds ``generator`` per epoch.

    Args:
        n: the dataset's length.
        batch_size: indices per batch.
        generator: the ``torch.Generator`` that shuffles (None with ``shuffle=False``).
        shuffle: permute each epoch (else ``0 .. n-1`` in order).
        drop_last: drop a last, smaller batch.

    Example:
        >>> import torch
        >>> s = PermutationBatchSampler(10, 4, torch.Generator().manual_seed(0))
        >>> [len(b) for b in s], len(set(torch.cat(list(s)).tolist()))  # 8 distinct of the 10 rows
        ([4, 4], 8)
    """

    def __init__(
        self, n: int, batch_size: int, generator: Any = None, *, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if n < 1 or batch_size < 1:
            raise BatchError(f"PermutationBatchSampler: expected n >= 1 and batch_size >= 1, found {n}, {batch_size}")
        if shuffle and generator is None:
            raise BridgeError(
                "PermutationBatchSampler: shuffle=True needs a torch.Generator (reseeded per epoch by "
                "TorchLoader); pass generator=torch.Generator()"
            )
        self.n, self.batch_size, self.generator = int(n), int(batch_size), generator
        self.shuffle, self.drop_last = shuffle, drop_last

    def __len__(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        import torch

        order = torch.randperm(self.n, generator=self.generator) if self.shuffle else torch.arange(self.n)
        return iter(order[: len(self) * self.batch_size].split(self.batch_size))


class TorchLoader(EpochIterator):
    """Iterate a torch ``DataLoader`` over epochs as numpy batches with a resumable position.

    Args:
        loader: a ``torch.utils.data.DataLoader`` yielding dicts of tensors, tuples / lists of tensors, or
            one tensor per batch. In a multi-process run each process's loader yields its own rows
            (e.g. through a ``DistributedSampler``).
        names: the keys for tuple / list / tensor batches, in order; not needed for dict batches.
        seed: the run's data seed; each epoch's generators are seeded from ``(seed, epoch)``.
        num_epochs: stop after this many epochs (``None``: never stop).
        mesh: when given, yield global ``jax.Array`` batches over this mesh instead of numpy.
        spec: the batch ``PartitionSpec`` (one, or one per key) used with ``mesh``.
    """

    def __init__(
        self,
        loader: Any,
        *,
        names: Sequence[str] | None = None,
        seed: int = 0,
        num_epochs: int | None = None,
        mesh: Mesh | None = None,
        spec: BatchSpec | None = None,
    ) -> None:
        from torch.utils.data import DataLoader

        if not isinstance(loader, DataLoader):
            raise BridgeError(f"TorchLoader: expected a torch DataLoader, found {type(loader).__name__}")
        if num_epochs is not None and num_epochs < 1:
            raise BatchError(f"TorchLoader: expected num_epochs >= 1 or None, found {num_epochs}")
        self._generators = _generators(loader)
        self.loader = loader
        self.names = None if names is None else tuple(names)
        super().__init__(seed=seed, num_epochs=num_epochs, mesh=mesh, spec=spec)

    def _open_epoch(self) -> Iterator[Any]:
        for g in self._generators:
            g.manual_seed(epoch_seed(self._seed, self._epoch))
        for obj in [*_samplers(self.loader), self.loader.dataset]:
            if callable(getattr(obj, "set_epoch", None)):
                obj.set_epoch(self._epoch)
        direct = _direct(self.loader)
        it = iter(self.loader if direct is None else direct[0])
        if direct is not None:  # as the DataLoader's iterator does: draw its base seed, so the order is its own
            import torch

            torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator)
        for skipped in range(self._position):  # the direct path skips indices, not loaded batches
            if next(it, None) is None:
                raise BatchError(
                    f"TorchLoader: the state says {self._position} batches of epoch {self._epoch} were consumed, "
                    f"but the loader has only {skipped}; resume with the loader the state was saved from"
                )
        return it if direct is None else map(direct[1], it)

    def _to_dict(self, batch: Any) -> dict[str, np.ndarray]:
        import torch

        if isinstance(batch, Mapping):
            items = list(batch.items())
        else:
            parts = [batch] if isinstance(batch, torch.Tensor) else list(batch)
            if self.names is None or len(self.names) != len(parts):
                raise BatchError(
                    f"TorchLoader: a batch of {len(parts)} tensors needs names=(...) with {len(parts)} keys, "
                    f"found names={self.names}; pass TorchLoader(loader, names=('x', 'y'))"
                )
            items = list(zip(self.names, parts, strict=True))
        bad = [str(k) for k, v in items if not isinstance(v, torch.Tensor)]
        if bad:
            raise BatchError(
                f"TorchLoader: expected every batch entry to be a torch.Tensor, found others at keys {bad}; "
                "encode them as tensors in the dataset or collate_fn"
            )
        return {str(k): torch_to_numpy(v) for k, v in items}


class TorchBatches(TorchLoader):
    """Iterate a torch ``DataLoader`` over epochs as its own batches (tensors, not numpy), with `TorchLoader`'s
    resumable position: each epoch reseeds the loader's generators and calls ``set_epoch`` on its samplers (a
    ``DistributedSampler`` shuffles by epoch), and `set_state` continues at the next unseen batch of that epoch.
    `openhosti_jax.frontends.torch_ddp.OptimizedDDP.loader` saves its state with every checkpoint.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> dl = DataLoader(TensorDataset(torch.arange(6)), batch_size=2, shuffle=True, generator=torch.Generator())
        >>> it = TorchBatches(dl, num_epochs=2)
        >>> seen = [next(it)[0].tolist() for _ in range(4)]  # epoch 0's three batches, then epoch 1's first
        >>> state = it.get_state(); state
        {'epoch': 1, 'position': 1, 'seed': 0}
        >>> rest = [b[0].tolist() for b in it]
        >>> resumed = TorchBatches(dl, num_epochs=2); resumed.set_state(state)
        >>> [b[0].tolist() for b in resumed] == rest, len(rest)
        (True, 2)
    """

    def _to_dict(self, batch: Any) -> Any:
        return batch


__all__ = ["PermutationBatchSampler", "TorchBatches", "TorchLoader", "epoch_seed"]
