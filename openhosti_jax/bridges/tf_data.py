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

from openhosti_jax.bridges.global_batch import BatchSpec, to_global_batch
from openhosti_jax.data.protocol import check_json_state
from openhosti_jax.errors import BatchError, BridgeError


class TFDatasetLoader:
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
        self.num_epochs = num_epochs
        self.mesh, self.spec = mesh, spec
        self._seed, self._epoch, self._position = int(seed), 0, 0
        self._it: Iterator[Any] | None = None

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

    def __iter__(self) -> TFDatasetLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        while True:
            if self.num_epochs is not None and self._epoch >= self.num_epochs:
                raise StopIteration
            fresh = self._it is None
            if fresh:
                self._it = self._open_epoch()
            element = next(self._it, None)
            if element is not None:
                break
            if fresh and self._position == 0:
                raise BatchError(f"TFDatasetLoader: the dataset yielded no element in epoch {self._epoch}")
            self._epoch, self._position, self._it = self._epoch + 1, 0, None
        self._position += 1
        local = self._to_dict(element)
        return local if self.mesh is None else to_global_batch(local, self.mesh, self.spec)

    def get_state(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed"}``: the next batch is element ``position`` of ``epoch``."""
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a `get_state` dict."""
        check_json_state(state, "TFDatasetLoader.set_state")
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise BatchError(
                f"TFDatasetLoader.set_state: expected keys epoch, position, seed; missing {sorted(missing)} in "
                f"{state!r}; pass a dict from TFDatasetLoader.get_state()"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise BatchError(f"TFDatasetLoader.set_state: expected epoch, position >= 0, found {epoch}, {position}")
        self._seed, self._epoch, self._position, self._it = int(state["seed"]), epoch, position, None


__all__ = ["TFDatasetLoader"]
