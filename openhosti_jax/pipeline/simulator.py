"""Play a `Schedule` with given per-chunk forward / backward times: makespan, bubble, peak in-flight.

Each stage runs its actions in order; an action starts when its stage is free and its inputs have arrived
(forward of chunk c needs forward of c-1, backward of c needs backward of c+1, plus ``comm_time`` across
stages).

Example:
    >>> from openhosti_jax.pipeline.schedule import gpipe
    >>> r = simulate(gpipe(4, 8), forward_times=1.0, backward_times=2.0)
    >>> round(r.bubble_fraction, 4), round(3 / 11, 4)
    (0.2727, 0.2727)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from openhosti_jax.errors import PipelineError
from openhosti_jax.pipeline.schedule import Action, Schedule


@dataclass(frozen=True)
class SimResult:
    """Outcome of playing a schedule."""

    makespan: float
    """Time from the first action's start to the last action's end."""
    bubble_fraction: float
    """Idle share of all stage time: ``1 - busy / (S * makespan)``."""
    peak_in_flight: tuple[int, ...]
    """Per stage, the most (microbatch, chunk) pairs between forward start and backward end at once."""
    timeline: tuple[tuple[tuple[Action, float, float], ...], ...]
    """Per stage, ``(action, start, end)`` in execution order."""


def _per_chunk(times: float | Sequence[float], n: int, name: str) -> np.ndarray:
    arr = np.broadcast_to(np.asarray(times, dtype=np.float64), (n,)) if np.ndim(times) == 0 else None
    if arr is None:
        arr = np.asarray(times, dtype=np.float64)
        if arr.shape != (n,):
            raise PipelineError(f"expected {name} as a scalar or {n} per-chunk values, found shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise PipelineError(f"{name} must be finite and >= 0, found {arr.tolist()}")
    return arr


def simulate(
    schedule: Schedule,
    forward_times: float | Sequence[float],
    backward_times: float | Sequence[float] | None = None,
    comm_time: float = 0.0,
) -> SimResult:
    """Play ``schedule``; times are per chunk (``S * V`` values) or a scalar; backward defaults to 2x."""
    s, c_total = schedule.num_stages, schedule.num_chunks
    fwd = _per_chunk(forward_times, c_total, "forward_times")
    bwd = 2.0 * fwd if backward_times is None else _per_chunk(backward_times, c_total, "backward_times")
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * s
    pos = [0] * s
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(s)]
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for d in range(s):
            while pos[d] < len(schedule.actions[d]):
                a = schedule.actions[d][pos[d]]
                c = schedule.chunk(d, a)
                if a.kind == "F":
                    dep = None if c == 0 else ("F", a.microbatch, c - 1)
                else:
                    dep = ("F", a.microbatch, c) if c == c_total - 1 else ("B", a.microbatch, c + 1)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (comm_time if dep[2] % s != d else 0.0)
                start = max(free[d], ready)
                end = start + float(fwd[c] if a.kind == "F" else bwd[c])
                done[(a.kind, a.microbatch, c)] = end
                free[d] = end
                timeline[d].append((a, start, end))
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {d: str(schedule.actions[d][pos[d]]) for d in range(s) if pos[d] < len(schedule.actions[d])}
            raise PipelineError(f"schedule {schedule.name!r} deadlocks: stages wait at {stuck}")
    makespan = max(free)
    busy = sum(e - b for row in timeline for _, b, e in row)
    bubble = 1.0 - busy / (s * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, bubble, tuple(_peak(row) for row in timeline), tuple(map(tuple, timeline)))


def _peak(row: list[tuple[Action, float, float]]) -> int:
    events = []
    for a, start, end in row:
        events.append((start, 1) if a.kind == "F" else (end, -1))
    count = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        count += delta
        peak = max(peak, count)
    return peak
