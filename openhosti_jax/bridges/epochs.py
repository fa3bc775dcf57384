"""`EpochIterator`: the resumable epoch/position bookkeeping shared by the torch and tf.data adapters.

A subclass opens an epoch's iterator (already advanced past ``self._position`` items) and turns one item into a
``dict[str, np.ndarray]``; this class counts items, rolls over epochs, shards onto a mesh and keeps the same JSON
state as `openhosti_jax.data.ArrayDataset`: ``{"epoch", "position", "seed"}``.

Example:
    >>> from openhosti_jax.bridges.epochs import EpochIterator
    >>> class Counting(EpochIterator):
    ...     def _open_epoch(self):
    ...         return iter(range(self._position, 3))
    ...     def _to_dict(self, item):
    ...         return {"x": item}
    >>> it = Counting(seed=0, num_epochs=None, mesh=None, spec=None)
    >>> [next(it)["x"] for _ in range(4)], it.get_state()
    ([0, 1, 2, 0], {'epoch': 1, 'position': 1, 'seed': 0})
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.sharding import Mesh

from openhosti_jax.data.protocol import position_state
from openhosti_jax.errors import BatchError
from openhosti_jax.sharding.batch import BatchSpec, place_batch


class EpochIterator:
    """Base of the resumable loader adapters; subclasses define ``_open_epoch`` and ``_to_dict``."""

    def __init__(self, *, seed: int, num_epochs: int | None, mesh: Mesh | None, spec: BatchSpec | None):
        self.num_epochs = num_epochs
        self.mesh, self.spec = mesh, spec
        self._seed, self._epoch, self._position = int(seed), 0, 0
        self._it: Iterator[Any] | None = None

    def _open_epoch(self) -> Iterator[Any]:
        raise NotImplementedError

    def _to_dict(self, item: Any) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        name = type(self).__name__
        while True:
            if self.num_epochs is not None and self._epoch >= self.num_epochs:
                raise StopIteration
            fresh = self._it is None
            if fresh:
                self._it = self._open_epoch()
            item = next(self._it, None)
            if item is not None:
                break
            if fresh and self._position == 0:
                raise BatchError(f"{name}: the source yielded no batch in epoch {self._epoch}")
            self._epoch, self._position, self._it = self._epoch + 1, 0, None
        self._position += 1
        local = self._to_dict(item)
        return local if self.mesh is None else place_batch(local, self.mesh, self.spec)

    def get_state(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed"}``: the next batch is batch ``position`` of ``epoch``."""
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a `get_state` dict; the next batch is the one after the last one it counted."""
        epoch, position, seed = position_state(state, f"{type(self).__name__}.set_state")
        self._seed, self._epoch, self._position, self._it = seed, epoch, position, None
