"""The memory a device really has, and making every process use process 0's answer.

Example:
    >>> from openhosti_jax.mesh.memory import agree_across_processes, budget_from_devices, device_memory_limit
    >>> budget_from_devices() > 0, device_memory_limit() is None  # CPU reports no limit: it shares host RAM
    (True, True)
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


def device_memory_limit(devices: Sequence[jax.Device] | None = None) -> int | None:
    """The smallest ``memory_stats()["bytes_limit"]`` over ``devices`` (default: the local ones): what the runtime
    lets one device allocate, below the spec sheet's size; None where the backend reports none (CPU)."""
    limits = []
    for d in list(devices) if devices is not None else jax.local_devices():
        try:
            stats = d.memory_stats()
        except (NotImplementedError, RuntimeError):
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def budget_from_devices(devices: Sequence[jax.Device] | None = None) -> int:
    """Bytes one device may use: `device_memory_limit`, or, on backends without memory stats (CPU, whose
    devices share the host's RAM), host RAM / local device count."""
    devices = list(devices) if devices is not None else jax.local_devices()
    limit = device_memory_limit(devices)
    if limit is not None:
        return limit
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
