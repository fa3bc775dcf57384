"""`GrainIterator`: a grain iterator behind the `StatefulIterator` protocol (JSON dict state).

grain's ``DataLoader`` iterators report their state as JSON-encoded ``bytes``, ``grain.DatasetIterator`` as
a ``dict``; this adapter turns either into ``{"grain": <dict>}`` and back, so the checkpoint manager can store
it like any other data state. grain itself is optional: the adapter only needs the iterator's ``get_state`` /
``set_state`` methods and never imports grain.

Example:
    >>> import grain  # doctest: +SKIP
    >>> it = GrainIterator(grain.MapDataset.range(10).batch(2).to_iter_dataset())  # doctest: +SKIP
    >>> _ = next(it); it.get_state()  # doctest: +SKIP
    {'grain': {...}}
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from openhosti_jax.data.protocol import check_json_state
from openhosti_jax.errors import BatchError


class GrainIterator:
    """Wrap a grain ``DataLoader`` / ``IterDataset`` (or an iterator of one) with dict state.

    Args:
        source: something whose ``iter()`` has ``get_state()`` and ``set_state(state)``.
    """

    def __init__(self, source: Iterable[Any]) -> None:
        self._it = iter(source)
        if not (callable(getattr(self._it, "get_state", None)) and callable(getattr(self._it, "set_state", None))):
            raise BatchError(
                f"GrainIterator: expected iter(source) to have get_state()/set_state(), found "
                f"{type(self._it).__name__} without them; pass a grain DataLoader or IterDataset"
            )
        self._bytes_state = isinstance(self._it.get_state(), bytes | bytearray)

    def __iter__(self) -> GrainIterator:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """``{"grain": state}`` with grain's own state decoded from JSON bytes when needed."""
        raw = self._it.get_state()
        inner = json.loads(bytes(raw).decode("utf-8")) if isinstance(raw, bytes | bytearray) else raw
        return check_json_state({"grain": inner}, "GrainIterator.get_state")

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a `get_state` dict."""
        check_json_state(state, "GrainIterator.set_state")
        if "grain" not in state:
            raise BatchError(
                f"GrainIterator.set_state: expected a dict with key 'grain', found keys {sorted(state)}; "
                "pass a dict from GrainIterator.get_state()"
            )
        inner = state["grain"]
        self._it.set_state(json.dumps(inner).encode("utf-8") if self._bytes_state else inner)
