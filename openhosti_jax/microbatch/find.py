"""The largest per-device microbatch whose compiled step fits the memory budget: binary search, AOT compiles.

Peak memory is assumed to grow with the microbatch size. The full per-device batch (one microbatch) is
compiled first; if it does not fit, a binary search over the smaller candidates (the divisors of the
per-device batch, or the sizes given) needs at most ``ceil(log2(per_device_batch)) + 2`` compiles in all.
Nothing is ever run, so no step ever goes out of memory during the search.

Example:
    >>> from openhosti_jax.microbatch import find_microbatch
    >>> class Fake:  # stands in for a jax.stages.Compiled whose peak is 100 bytes per sample
    ...     def __init__(self, n): self.n = n
    >>> choice = find_microbatch(Fake, 12, budget_bytes=700, margin=0.0, peak_fn=lambda c: 100 * c.n)
    >>> choice.size, choice.num_microbatches, choice.compiles
    (6, 2, 4)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from openhosti_jax.errors import MemoryBudgetError, PlanningError
from openhosti_jax.mesh.barrier import gathered
from openhosti_jax.mesh.memory import budget_from_devices
from openhosti_jax.microbatch.probe import PeakFn, peak_bytes
from openhosti_jax.sizes import divisors

_AGREE_TIMEOUT_S = 1800.0
"""How long a process waits for process 0's choice: a process whose budget lets it probe more sizes compiles longer."""


def compile_bound(per_device_batch: int) -> int:
    """Most compiles `find_microbatch` may use: ``ceil(log2(per_device_batch)) + 2``."""
    return math.ceil(math.log2(per_device_batch)) + 2


@dataclass(frozen=True)
class MicrobatchChoice:
    """The chosen per-device microbatch and how it was found."""

    size: int
    """Per-device microbatch size."""
    num_microbatches: int
    """Accumulation steps per optimizer step: ``ceil(per_device_batch / size)``."""
    per_device_batch: int
    """Samples per device per optimizer step."""
    peak_bytes: int
    """Per-device peak bytes of the chosen compiled step."""
    limit_bytes: int
    """What had to fit: ``budget * (1 - margin)``."""
    budget_bytes: int
    """Per-device memory budget."""
    compiles: int
    """AOT compiles the search used."""
    tried: tuple[tuple[int, int], ...]
    """``(size, peak_bytes)`` of every compile, in order."""
    seconds: float
    """Wall time of the search."""
    compiled: Any = field(default=None, repr=False, compare=False)
    """The chosen size's compiled step, when this process compiled it (reuse it instead of recompiling)."""

    def __post_init__(self) -> None:
        if not 1 <= self.size <= self.per_device_batch:
            raise PlanningError(f"expected 1 <= size <= {self.per_device_batch}, found size={self.size}")

    def __str__(self) -> str:
        mib = 2**20
        tried = ", ".join(f"{s}:{p / mib:.1f}" for s, p in self.tried)
        return (
            f"microbatch {self.size} x {self.num_microbatches} (per-device batch {self.per_device_batch}); "
            f"peak {self.peak_bytes / mib:.1f} MiB <= {self.limit_bytes / mib:.1f} MiB "
            f"(budget {self.budget_bytes / mib:.1f} MiB); {self.compiles} compiles in {self.seconds:.2f}s "
            f"[size:MiB {tried}]"
        )


def find_microbatch(
    compile_for: Callable[[int], jax.stages.Compiled],
    per_device_batch: int,
    budget_bytes: int | None = None,
    margin: float = 0.1,
    *,
    sizes: Sequence[int] | None = None,
    peak_fn: PeakFn = peak_bytes,
) -> MicrobatchChoice:
    """The largest size in ``sizes`` (default: divisors of ``per_device_batch``) whose peak fits.

    Args:
      compile_for: ``size -> compiled step`` for that per-device microbatch (``jit(f).lower(...).compile()``).
      per_device_batch: samples per device per optimizer step.
      budget_bytes: per-device budget; default `budget_from_devices`.
      margin: headroom kept free; a size fits when ``peak <= budget * (1 - margin)``.
      sizes: candidate sizes (each in ``1..per_device_batch``; a non-divisor needs padding, see `accumulate`).
      peak_fn: ``compiled -> peak bytes`` (default `peak_bytes`: XLA's analysis, else the analytic bound).

    With several processes every process returns process 0's size and peak.
    """
    if not isinstance(per_device_batch, int) or per_device_batch < 1:
        raise PlanningError(f"expected per_device_batch to be a positive int, found {per_device_batch!r}")
    if not 0.0 <= margin < 1.0:
        raise PlanningError(f"expected 0 <= margin < 1, found margin={margin}")
    candidates = tuple(sorted(set(sizes))) if sizes is not None else divisors(per_device_batch)
    bad = [s for s in candidates if not (isinstance(s, int) and 1 <= s <= per_device_batch)]
    if bad or not candidates:
        raise PlanningError(f"expected candidate sizes in 1..{per_device_batch}, found {list(candidates)}; drop {bad}")
    budget = int(budget_from_devices() if budget_bytes is None else budget_bytes)
    limit = int(budget * (1.0 - margin))
    start = time.perf_counter()
    tried: list[tuple[int, int]] = []
    compiled_by_size: dict[int, Any] = {}

    def fits(index: int) -> bool:
        size = candidates[index]
        compiled = compile_for(size)
        peak = peak_fn(compiled)
        if peak is None:
            raise PlanningError(
                f"cannot measure the peak memory of microbatch {size}: the backend reports no memory or cost "
                "analysis; pass peak_fn= (e.g. the planner's estimate) or choose the microbatch yourself"
            )
        tried.append((size, int(peak)))
        compiled_by_size[size] = compiled
        return peak <= limit

    last = len(candidates) - 1
    if fits(last):
        best = last
    else:
        lo, hi = -1, last  # candidates[lo] fits (or none yet), candidates[hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        if lo < 0:
            smallest, need = tried[-1]
            raise MemoryBudgetError(
                f"expected some microbatch to fit {limit} bytes per device (budget {budget}, margin "
                f"{margin}), found microbatch {smallest} needs {need} bytes; shard the model further "
                "(fsdp/tensor/stage), lower the margin, or raise the budget"
            )
        best = lo
    size = candidates[best]
    peak = dict(tried)[size]
    size, peak = gathered("microbatch-choice", (size, peak), timeout_s=_AGREE_TIMEOUT_S)[0]  # process 0's
    return MicrobatchChoice(
        size=size,
        num_microbatches=-(-per_device_batch // size),
        per_device_batch=per_device_batch,
        peak_bytes=peak,
        limit_bytes=limit,
        budget_bytes=budget,
        compiles=len(tried),
        tried=tuple(tried),
        seconds=time.perf_counter() - start,
        compiled=compiled_by_size.get(size),
    )
