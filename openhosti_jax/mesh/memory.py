"""The memory a device really has (processes agree on what they make of it through `openhosti_jax.mesh.barrier`).

Example:
    >>> from openhosti_jax.mesh.memory import budget_from_devices, device_memory_limit
    >>> budget_from_devices() > 0, device_memory_limit() is None  # CPU reports no limit: it shares host RAM
    (True, True)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

from openhosti_jax.errors import MemoryBudgetError


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
