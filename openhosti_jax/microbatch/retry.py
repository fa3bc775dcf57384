"""Run-time OOM safety: an out-of-memory step halves the microbatch, recompiles, re-runs the same batch.

The failed attempt must leave the state usable. XLA allocates a step's buffers when it launches, and a launch
that fails releases its hold on donated inputs, so the caller's state (params, optimizer state, step counter)
is still intact and is passed unchanged to the retry. That is checked, not assumed: if any leaf of the state
or batch was consumed (``is_deleted()``), the error is a `StateError` telling the caller to restore the last
checkpoint, never a silent retry on freed buffers.

Example:
    >>> from openhosti_jax.microbatch import OOMRetryStep
    >>> build = lambda size: (lambda s, b: (s + sum(b), {"size": size}))
    >>> step = OOMRetryStep(build, per_device_batch=8, size=8)
    >>> step(0, [1, 2])
    (3, {'size': 8})
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax

from openhosti_jax.errors import MemoryBudgetError, StateError
from openhosti_jax.sizes import divisors
from openhosti_jax.state.contracts import StepFn

log = logging.getLogger(__name__)


def is_resource_exhausted(err: BaseException) -> bool:
    """True for an XLA runtime error whose message says RESOURCE_EXHAUSTED (an out-of-memory)."""
    return isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err)


def halve_microbatch(size: int, per_device_batch: int) -> int | None:
    """The largest divisor of ``per_device_batch`` that is at most ``size // 2``; ``None`` below 1."""
    smaller = [d for d in divisors(per_device_batch) if d <= size // 2]
    return smaller[-1] if smaller else None


def _consumed(tree: Any) -> list[str]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [jax.tree_util.keystr(p) for p, x in leaves if isinstance(x, jax.Array) and x.is_deleted()]


class OOMRetryStep:
    """A train step that survives RESOURCE_EXHAUSTED by shrinking its per-device microbatch.

    ``build(size)`` returns the step for that microbatch size (usually a jitted `make_train_step` with
    ``num_microbatches = per_device_batch // size``); it is called lazily, and again after each shrink. The
    current size and every shrink ``(old, new)`` are kept on the object; ``on_resize(old, new)`` is also
    called.
    """

    def __init__(
        self,
        build: Callable[[int], StepFn],
        per_device_batch: int,
        size: int,
        *,
        on_resize: Callable[[int, int], None] | None = None,
    ) -> None:
        if size not in divisors(per_device_batch):
            raise MemoryBudgetError(
                f"expected the microbatch size to divide the per-device batch {per_device_batch}, found "
                f"{size}; use one of {divisors(per_device_batch)}"
            )
        self.build = build
        self.per_device_batch = per_device_batch
        self.size = size
        self.on_resize = on_resize
        self.resizes: list[tuple[int, int]] = []
        self._step: StepFn | None = None

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        while True:
            try:
                if self._step is None:
                    self._step = self.build(self.size)
                return self._step(state, batch)
            except jax.errors.JaxRuntimeError as err:
                if not is_resource_exhausted(err):
                    raise
                self._shrink(err, state, batch)

    def _shrink(self, err: jax.errors.JaxRuntimeError, state: Any, batch: Any) -> None:
        consumed = _consumed((state, batch))
        if consumed:
            raise StateError(
                f"a RESOURCE_EXHAUSTED step at microbatch {self.size} consumed donated inputs "
                f"{consumed[:5]}{' ...' if len(consumed) > 5 else ''}; expected them intact to retry. "
                "Restore the last checkpoint and restart with a smaller microbatch"
            ) from err
        smaller = halve_microbatch(self.size, self.per_device_batch)
        if smaller is None:
            raise MemoryBudgetError(
                f"out of memory at microbatch 1 (per-device batch {self.per_device_batch}); expected a size "
                "that fits. Shard the model further (fsdp/tensor/stage) or lower the per-device batch"
            ) from err
        log.warning("RESOURCE_EXHAUSTED at microbatch %d; retrying the same batch at %d", self.size, smaller)
        self.resizes.append((self.size, smaller))
        old, self.size, self._step = self.size, smaller, None
        if self.on_resize is not None:
            self.on_resize(old, smaller)
