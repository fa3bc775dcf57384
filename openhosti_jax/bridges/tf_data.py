"""`TFDatasetLoader`: a ``tf.data`` pipeline as a resumable iterator of numpy (or sharded global) batches.

Yields ``dict[str, np.ndarray]`` like `openhosti_jax.data.ArrayDataset` (or ``dict[str, jax.Array]`` given a
mesh) with the same JSON position ``{"epoch", "position", "seed"}``. For a resume to land on the same sample
each epoch's order must be fixed: pass a function ``make_dataset(epoch, seed)`` that builds the epoch's
pipeline (shuffle with ``seed=seed + epoch``), or a dataset whose order never changes. A resume skips the
first ``position`` elements with ``Dataset.skip``.

Example:
    >>> import tensorflow as tf
    >>> def make(epoch, seed):
    ...     return tf.data.Dataset.range(8).shuffle(8, seed=seed + epoch).batch(4)
    >>> it = TFDatasetLoader(make, names=("x",), seed=1)
    >>> next(it)["x"].shape, it.get_state()
    ((4,), {'epoch': 0, 'position': 1, 'seed': 1})
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from openhosti_jax.bridges.epochs import EpochIterator
from openhosti_jax.errors import BatchError, BridgeError
from openhosti_jax.sharding.batch import BatchSpec


class TFDatasetLoader(EpochIterator):
    """Iterate a ``tf.data.Dataset`` over epochs as numpy batches with a resumable position.

    Args:
        dataset: a batched ``tf.data.Dataset`` (the same order every epoch), or ``make_dataset(epoch, seed)``
            returning the epoch's batched dataset. Elements are dicts of tensors, tuples of tensors or one
            tensor. In a multi-process run each process's pipeline yields its own rows (``Dataset.shard``).
        names: the keys for tuple / tensor elements, in order; not needed for dict elements.
        seed: passed to ``make_dataset``; stored in the state.
        num_epochs: stop after this many epochs (``None``: never stop).
        mesh: when given, yield global ``jax.Array`` batches over this mesh instead of numpy.
        spec: the batch ``PartitionSpec`` (one, or one per key) used with ``mesh``.
    """

    def __init__(
        self,
        dataset: Any | Callable[[int, int], Any],
        *,
        names: Sequence[str] | None = None,
        seed: int = 0,
        num_epochs: int | None = None,
        mesh: Mesh | None = None,
        spec: BatchSpec | None = None,
    ) -> None:
        import tensorflow as tf

        if not (isinstance(dataset, tf.data.Dataset) or callable(dataset)):
            raise BridgeError(
                f"TFDatasetLoader: expected a tf.data.Dataset or make_dataset(epoch, seed), found "
                f"{type(dataset).__name__}"
            )
        if num_epochs is not None and num_epochs < 1:
            raise BatchError(f"TFDatasetLoader: expected num_epochs >= 1 or None, found {num_epochs}")
        self._make = dataset if callable(dataset) and not isinstance(dataset, tf.data.Dataset) else None
        self._dataset = None if self._make else dataset
        self.names = None if names is None else tuple(names)
        super().__init__(seed=seed, num_epochs=num_epochs, mesh=mesh, spec=spec)

    def _open_epoch(self) -> Iterator[Any]:
        import tensorflow as tf

        ds = self._dataset if self._make is None else self._make(self._epoch, self._seed)
        if not isinstance(ds, tf.data.Dataset):
            raise BridgeError(f"TFDatasetLoader: make_dataset returned {type(ds).__name__}, not a tf.data.Dataset")
        size = int(ds.cardinality())
        if size >= 0 and self._position > size:
            raise BatchError(
                f"TFDatasetLoader: the state says {self._position} batches of epoch {self._epoch} were consumed, "
                f"but the dataset has only {size}; resume with the pipeline the state was saved from"
            )
        return iter(ds.skip(self._position) if self._position else ds)

    def _to_dict(self, element: Any) -> dict[str, np.ndarray]:
        if isinstance(element, Mapping):
            items = list(element.items())
        else:
            parts = list(element) if isinstance(element, tuple | list) else [element]
            if self.names is None or len(self.names) != len(parts):
                raise BatchError(
                    f"TFDatasetLoader: an element of {len(parts)} tensors needs names=(...) with {len(parts)} "
                    f"keys, found names={self.names}; pass TFDatasetLoader(ds, names=('x', 'y'))"
                )
            items = list(zip(self.names, parts, strict=True))
        bad = [str(k) for k, v in items if not hasattr(v, "numpy") or v.dtype.name in ("string", "variant")]
        if bad:
            raise BatchError(
                f"TFDatasetLoader: expected numeric tensors, found nested or string values at keys {bad}; "
                "map them to numbers (and flat dicts) in the pipeline"
            )
        return {str(k): v.numpy() for k, v in items}


__all__ = ["TFDatasetLoader"]
