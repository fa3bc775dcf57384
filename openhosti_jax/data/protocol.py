"""`StatefulIterator`: the protocol every data source follows so a checkpoint can record its position.

An iterator yields batches and reports a small JSON-able ``dict`` with `get_state`; `set_state` on a fresh
iterator built the same way makes it continue at exactly the next sample. The checkpoint manager stores this
dict next to the arrays (``data_state=it.get_state()``) and hands it back on restore.

Example:
    >>> import numpy as np
    >>> from openhosti_jax.data import ArrayDataset, StatefulIterator
    >>> it = ArrayDataset({"x": np.arange(8)}, global_batch_size=2, seed=0)
    >>> isinstance(it, StatefulIterator)
    True
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from openhosti_jax.errors import BatchError


@runtime_checkable
class StatefulIterator(Protocol):
    """An iterator of batches whose position is a JSON-able dict (``get_state`` / ``set_state``)."""

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def get_state(self) -> dict[str, Any]:
        """The position after the last batch returned, as a dict that survives ``json.dumps``/``loads``."""
        ...

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a dict returned by `get_state` (of an iterator built with the same data)."""
        ...


def check_json_state(state: Any, where: str) -> dict[str, Any]:
    """Raise `BatchError` unless ``state`` is a dict that round-trips through JSON unchanged; return it."""
    if not isinstance(state, dict):
        raise BatchError(f"{where}: expected the iterator state to be a dict, found {type(state).__name__}")
    try:
        again = json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise BatchError(
            f"{where}: the iterator state must be JSON-able (str/int/float/bool/list/dict), found {state!r}: {e}"
        ) from e
    if again != state:
        raise BatchError(
            f"{where}: the iterator state changes through JSON ({state!r} -> {again!r}); use str keys and "
            "lists instead of tuples"
        )
    return state


def epoch_order(seed: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
    """The order of ``n`` samples in ``epoch``: a permutation drawn from ``(seed, epoch)``, the same on every
    process and every run, or ``0 .. n - 1`` without ``shuffle``."""
    return np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)


def position_state(state: Any, where: str, max_position: int | None = None) -> tuple[int, int, int]:
    """``(epoch, position, seed)`` of a ``{"epoch", "position", "seed"}`` iterator state; `BatchError` if it is
    not JSON-able, lacks a key, or is out of range (``0 <= position <= max_position`` when given)."""
    check_json_state(state, where)
    missing = {"epoch", "position", "seed"} - set(state)
    if missing:
        raise BatchError(
            f"{where}: expected keys epoch, position, seed; missing {sorted(missing)} in {state!r}; pass a dict "
            "from the same iterator type's get_state()"
        )
    epoch, position = int(state["epoch"]), int(state["position"])
    limit = "" if max_position is None else f" <= {max_position} (steps per epoch)"
    if epoch < 0 or position < 0 or (max_position is not None and position > max_position):
        raise BatchError(
            f"{where}: expected epoch >= 0 and 0 <= position{limit}, found epoch {epoch}, position {position}; "
            "was the state saved for a different data source, dataset size or global batch size?"
        )
    return epoch, position, int(state["seed"])
