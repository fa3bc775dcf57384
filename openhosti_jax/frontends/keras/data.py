"""tf.data inputs as ``tf.distribute`` code hands them over, and a data position a resumed ``fit`` picks up.

``experimental_distribute_dataset(ds)`` takes a pipeline batched by the global batch size; Keras splits each batch
over the mesh's batch axes (in a multi-process run each process keeps its share, as Keras's auto-sharding does).
``distribute_datasets_from_function(fn)`` calls ``fn`` once per process with an `InputContext`; its pipeline is
batched per replica and this process's replicas' batches are joined into one (tf.distribute feeds them to its
replicas in turn, so a step sees the same examples).

`DataPosition` skips the batches a checkpoint says were consumed: when a checkpoint callback will resume, the next
tf.data pipeline Keras is given is read through ``skip(n).take(m)``, with ``n`` and ``m`` TF variables read as each
pass over it starts; the callback sets them on resume and resets them once the resumed epoch has begun. (A repeated
pipeline with ``steps_per_epoch`` is one stream Keras keeps across epochs: its resumed pass takes the rest of the
epoch, and the next pass continues the stream where the following epoch starts.) The pipeline keeps
reporting its own cardinality (`PositionedDataset`): Keras sizes every epoch by it, so a short first pass must not
become the epoch length. The skipped batches are the ones a new pass yields first: a pipeline in the same order every
pass resumes exactly, one that reshuffles each pass resumes at the right count in a new order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openhosti_jax.errors import BatchError, BridgeError
from openhosti_jax.frontends.keras._backend import tensorflow_module


class InputContext:
    """What ``distribute_datasets_from_function``'s ``fn`` is told, as ``tf.distribute.InputContext`` tells it."""

    def __init__(self, num_input_pipelines: int, input_pipeline_id: int, num_replicas_in_sync: int) -> None:
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync
        self.per_replica_batch_size: int | None = None
        """The last answer of `get_per_replica_batch_size`: how ``fn`` batched its pipeline."""

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size`` over the replicas; a `BatchError` if it does not divide."""
        if global_batch_size % self.num_replicas_in_sync:
            raise BatchError(
                f"the global batch size {global_batch_size} is not divisible by num_replicas_in_sync "
                f"{self.num_replicas_in_sync}; use a multiple of it"
            )
        self.per_replica_batch_size = global_batch_size // self.num_replicas_in_sync
        return self.per_replica_batch_size

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self.num_input_pipelines}, input_pipeline_id="
            f"{self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def check_batched(dataset: Any, where: str) -> Any:
    """``dataset`` if it is a batched ``tf.data.Dataset``; a `BridgeError` saying what to pass otherwise."""
    tf = tensorflow_module()
    if not isinstance(dataset, tf.data.Dataset):
        raise BridgeError(f"{where}: expected a tf.data.Dataset, found {type(dataset).__name__}")
    specs = tf.nest.flatten(dataset.element_spec)
    if not specs or not all(getattr(s, "shape", None) is not None and s.shape.rank for s in specs):
        raise BridgeError(
            f"{where}: the dataset is not batched (an element has a scalar); call dataset.batch(global_batch_size)"
        )
    return dataset


def from_function(fn: Callable[[InputContext], Any], context: InputContext, local_replicas: int) -> Any:
    """``fn(context)``'s per-replica batches joined ``local_replicas`` at a time: this process's global share."""
    dataset = check_batched(fn(context), "distribute_datasets_from_function")
    size = context.per_replica_batch_size
    if size is None:
        first = dataset.element_spec
        dims = {s.shape[0] for s in tensorflow_module().nest.flatten(first)}
        size = dims.pop() if len(dims) == 1 and None not in dims else None
    if size is None:
        raise BatchError(
            "distribute_datasets_from_function: the per-replica batch size is unknown; batch the pipeline with "
            "input_context.get_per_replica_batch_size(global_batch_size) (or a fixed, drop_remainder batch)"
        )
    joined = dataset.rebatch(size * local_replicas) if local_replicas > 1 else dataset
    joined._openhosti_per_process = True  # Keras must not split it between processes again
    return joined


ENDLESS = 2**62
"""The cardinality a positioned endless pipeline reports: finite, so Keras (sizing epochs by ``steps_per_epoch``)
never learns an epoch length from the resumed pass that ends early, and never reached."""


class PositionedDataset:
    """A tf.data pipeline read through a skip: iterates ``skipped``, reports ``source``'s cardinality, and is
    otherwise ``skipped`` (element spec, options)."""

    def __init__(self, source: Any, skipped: Any) -> None:
        self.source, self.skipped = source, skipped

    def cardinality(self) -> Any:
        size = int(self.source.cardinality())
        return ENDLESS if size == -1 else size  # -1 (infinite) would let a short pass set Keras's epoch length

    def __iter__(self) -> Any:
        return iter(self.skipped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.skipped, name)


class DataPosition:
    """Batches to skip in the next pass over a tf.data pipeline (see the module docstring)."""

    def __init__(self) -> None:
        self.armed = False
        self.wrapped = False
        """Whether a pipeline was given to Keras since `arm` (else its inputs cannot be positioned)."""
        self.infinite = False
        """Whether that pipeline repeats forever (Keras then keeps one iterator across epochs)."""
        self._skip: Any = None
        self._take: Any = None

    def arm(self) -> None:
        """Read the next pipeline Keras is given through a skip (a checkpoint is about to be resumed)."""
        self.armed, self.wrapped, self.infinite = True, False, False

    def wrap(self, dataset: Any) -> Any:
        """``dataset`` read through the skip when armed (the arming is used up); else ``dataset`` as it is."""
        tf = tensorflow_module()
        if not self.armed or not isinstance(dataset, tf.data.Dataset):
            return dataset
        self.armed, self.wrapped = False, True
        self.infinite = int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
        self._skip = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._take = tf.Variable(-1, dtype=tf.int64, trainable=False)
        skip, take = self._skip, self._take
        start = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
        skipped = start.flat_map(lambda _: dataset.skip(skip).take(take))
        return PositionedDataset(dataset, skipped)

    def set(self, batches: int, take: int = -1) -> None:
        """Skip ``batches`` and then read ``take`` (-1: all) when the next pass over the wrapped pipeline starts."""
        if self._skip is not None:
            self._skip.assign(batches)
            self._take.assign(take)

    def disarm(self) -> None:
        """Stop skipping: later passes read the pipeline from its start."""
        self.armed = False
        self.set(0)


__all__ = ["DataPosition", "InputContext", "PositionedDataset", "check_batched", "from_function"]
