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
