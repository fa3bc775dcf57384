"""Per-device memory budget, and making every process use process 0's answer.

Example:
    >>> from openhosti_jax.microbatch import agree_across_processes, budget_from_devices
    >>> budget_from_devices() > 0
    True
    >>> agree_across_processes((3, 2**40))  # one process: unchanged
    (3, 1099511627776)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from openhosti_jax.errors import MemoryBudgetError

_BASE = 2**30  # ints travel as int32 digit pairs: broadcasts run with x64 disabled


def _host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_from_devices(devices: Sequence[jax.Device] | None = None) -> int:
    """Bytes one device may use: the smallest ``memory_stats()["bytes_limit"]`` over ``devices``.

    Backends without memory stats (CPU) share the host's RAM, so the budget is host RAM / local device count.
    """
    devices = list(devices) if devices is not None else jax.local_devices()
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except (NotImplementedError, RuntimeError):
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    if limits:
        return min(limits)
    host = _host_ram_bytes()
    if host <= 0:
        raise MemoryBudgetError(
            "expected device memory stats or host RAM size, found neither; pass budget_bytes explicitly"
        )
    return host // max(1, len(devices))


def agree_across_processes(values: Sequence[int]) -> tuple[int, ...]:
    """Process 0's ``values`` (non-negative ints) on every process; unchanged in a single-process run."""
    values = tuple(int(v) for v in values)
    if any(v < 0 for v in values):
        raise MemoryBudgetError(f"expected non-negative ints to agree on, found {values}")
    if jax.process_count() == 1:
        return values
    digits = np.asarray([[v // _BASE, v % _BASE] for v in values], np.int32)
    agreed = np.asarray(multihost_utils.broadcast_one_to_all(digits))
    return tuple(int(hi) * _BASE + int(lo) for hi, lo in agreed)
