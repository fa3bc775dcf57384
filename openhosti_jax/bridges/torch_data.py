"""`TorchLoader`: a torch ``DataLoader`` as a resumable iterator of numpy (or sharded global) batches.

It yields ``dict[str, np.ndarray]`` batches like the native `openhosti_jax.data.ArrayDataset` (or, given a
mesh, ``dict[str, jax.Array]`` global batches through `to_global_batch`) and reports the same JSON position
``{"epoch", "position", "seed"}``: ``position`` batches of ``epoch`` were consumed.

Each epoch's order must be reproducible for a resume to land on the same sample. Before each epoch the adapter
reseeds the loader's ``torch.Generator`` (and any sampler's own generator) from ``(seed, epoch)`` and calls
``set_epoch(epoch)`` on samplers that have it (``DistributedSampler``). A shuffling ``RandomSampler`` without
a generator draws from torch's global RNG and is refused. On resume the first ``position`` batches of the epoch
are loaded again and dropped (their cost is paid once).

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

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from openhosti_jax.bridges.epochs import EpochIterator
from openhosti_jax.bridges.global_batch import BatchSpec
from openhosti_jax.bridges.tensors import torch_to_numpy
from openhosti_jax.errors import BatchError, BridgeError


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
    from torch.utils.data import RandomSampler

    gens = [] if loader.generator is None else [loader.generator]
    for s in _samplers(loader):
        if isinstance(s, RandomSampler):
            if s.generator is None:
                raise BridgeError(
                    "TorchLoader: expected reproducible shuffling, found a RandomSampler without a generator "
                    "(it draws from torch's global RNG, so a resumed run would see another order); pass "
                    "DataLoader(..., shuffle=True, generator=torch.Generator()) or use a DistributedSampler"
                )
            if all(s.generator is not g for g in gens):
                gens.append(s.generator)
    return gens


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
        it = iter(self.loader)
        for skipped in range(self._position):
            if next(it, None) is None:
                raise BatchError(
                    f"TorchLoader: the state says {self._position} batches of epoch {self._epoch} were consumed, "
                    f"but the loader has only {skipped}; resume with the loader the state was saved from"
                )
        return it

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


__all__ = ["TorchLoader", "epoch_seed"]
