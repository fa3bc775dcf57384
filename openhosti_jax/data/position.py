"""`CountingIterator`: a position for data that has none, restored by skipping batches.

A plain generator or list has no ``get_state``; a checkpoint would save no position and a resumed run would replay
the data from the start. Wrapped, its position is the number of batches taken. `set_state` moves forward by
taking and dropping batches; moving back re-iterates the source from the start when the source can be iterated
again (a list, a dataset object whose ``__iter__`` starts over) and refuses otherwise. Skipping is exact when the
source yields the same batches in the same order every time it is built (a seeded generator).

Example:
    >>> from openhosti_jax.data.position import CountingIterator
    >>> it = CountingIterator([10, 11, 12, 13])
    >>> next(it), next(it), it.get_state()
    (10, 11, {'batches': 2})
    >>> again = CountingIterator([10, 11, 12, 13])
    >>> again.set_state({"batches": 3})
    >>> next(again)
    13
    >>> it.set_state({"batches": 0}); next(it)  # a list can be read again from the start
    10
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from openhosti_jax.data.protocol import check_json_state
from openhosti_jax.errors import BatchError


def restartable(source: Iterable[Any]) -> bool:
    """True when ``iter(source)`` starts over (a container or a dataset object), False for a one-shot iterator."""
    return iter(source) is not source


class CountingIterator:
    """An iterator over ``source`` whose state is ``{"batches": n}``, the batches taken so far."""

    def __init__(self, source: Iterable[Any]) -> None:
        self.source = source
        self._it: Iterator[Any] = iter(source)
        self._taken = 0

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self._taken += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        """``{"batches": n}``: the next batch is the source's batch ``n`` (from 0)."""
        return {"batches": self._taken}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue at batch ``state["batches"]`` by skipping; `BatchError` if the source ends first, or if that
        is behind the current position and the source cannot be iterated again."""
        check_json_state(state, "CountingIterator.set_state")
        if not isinstance(state.get("batches"), int) or state["batches"] < 0:
            raise BatchError(
                f"CountingIterator.set_state: expected {{'batches': n}} with n >= 0, found {state!r}; pass a dict "
                "from CountingIterator.get_state()"
            )
        target = state["batches"]
        if target < self._taken:
            if not restartable(self.source):
                raise BatchError(
                    f"cannot move the data back from batch {self._taken} to batch {target}: the source is a one-shot "
                    f"iterator ({type(self.source).__name__}); pass a list, a dataset object that iterates again, "
                    "or an iterator with get_state()/set_state() (openhosti_jax.data.ArrayDataset)"
                )
            self._it, self._taken = iter(self.source), 0
        while self._taken < target:
            try:
                next(self)
            except StopIteration:
                raise BatchError(
                    f"the data ended after {self._taken} batches while skipping to batch {target} (the saved "
                    "position); resume with the same data the checkpoint was trained on"
                ) from None
