"""Compile a `Schedule` into the lock-step tick table the SPMD executor scans over.

At every tick each stage runs at most one action; what it sends at the end of tick ``t`` is stored by its
neighbour before tick ``t + 1``. Start ticks come from `simulate` with unit times, and every received tensor
gets a buffer slot (allocated on arrival, freed after the backward that consumes it), so the executor's
buffers hold exactly the schedule's in-flight microbatches.

Example:
    >>> from openhosti_jax.pipeline.schedule import one_f_one_b
    >>> t = tick_table(one_f_one_b(2, 4))
    >>> t.num_ticks, t.num_act_slots
    (10, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from openhosti_jax.pipeline.schedule import Schedule
from openhosti_jax.pipeline.simulator import simulate

IDLE, FORWARD, BACKWARD = 0, 1, 2
FIELDS = ("op", "chunk", "microbatch", "act_slot", "grad_slot", "recv_act_slot", "recv_grad_slot")


@dataclass(frozen=True, eq=False)
class TickTable:
    """``table[t, stage, field]`` with `FIELDS`; slot ``num_act_slots`` / ``num_grad_slots`` discards."""

    table: np.ndarray
    """int32 array of shape ``(num_ticks, num_stages, len(FIELDS))``."""
    num_act_slots: int
    """Stage-input buffers needed per stage (the peak in-flight count)."""
    num_grad_slots: int
    """Received-gradient buffers needed per stage."""

    @property
    def num_ticks(self) -> int:
        """Lock-step ticks of the whole schedule."""
        return int(self.table.shape[0])


class _Slots:
    def __init__(self) -> None:
        self.free: list[int] = []
        self.used = 0
        self.of: dict[tuple[int, int], int] = {}

    def take(self, key: tuple[int, int]) -> int:
        slot = self.free.pop() if self.free else self.used
        self.used = max(self.used, slot + 1)
        self.of[key] = slot
        return slot

    def release(self, key: tuple[int, int]) -> int:
        slot = self.of.pop(key)
        self.free.append(slot)
        return slot


def tick_table(schedule: Schedule) -> TickTable:
    """The executor's per-tick, per-stage actions and buffer slots for ``schedule``."""
    s, n_chunks = schedule.num_stages, schedule.num_chunks
    sim = simulate(schedule, 1.0, 1.0)
    ticks = int(round(sim.makespan))
    rows = np.zeros((ticks, s, len(FIELDS)), dtype=np.int64)
    at = {}  # (tick, stage) -> (op, chunk, microbatch)
    for d, line in enumerate(sim.timeline):
        for a, start, _ in line:
            at[(int(round(start)), d)] = (
                FORWARD if a.kind == "F" else BACKWARD,
                schedule.chunk(d, a),
                a.microbatch,
            )
    acts = [_Slots() for _ in range(s)]
    grads = [_Slots() for _ in range(s)]
    arrivals: list[list[tuple[int, str, int, int]]] = [[] for _ in range(ticks)]
    for (t, d), (op, c, m) in at.items():
        if op == FORWARD and c < n_chunks - 1:
            arrivals[t].append(((d + 1) % s, "act", c + 1, m))
        if op == BACKWARD and c > 0:
            arrivals[t].append(((d - 1) % s, "grad", c - 1, m))
    for t in range(ticks):
        for d in range(s):
            op, c, m = at.get((t, d), (IDLE, 0, 0))
            rows[t, d, :3] = (op, c, m)
            rows[t, d, 3:5] = -1
            if op != IDLE and c > 0:
                key = (c, m)
                rows[t, d, 3] = acts[d].release(key) if op == BACKWARD else acts[d].of[key]
            if op == BACKWARD and c < n_chunks - 1:
                rows[t, d, 4] = grads[d].release((c, m))
            rows[t, d, 5:7] = -1
        for d, kind, c, m in arrivals[t]:
            field = 5 if kind == "act" else 6
            rows[t, d, field] = (acts if kind == "act" else grads)[d].take((c, m))
    n_act = max(1, max(a.used for a in acts))
    n_grad = max(1, max(g.used for g in grads))
    for field, discard in ((3, n_act), (4, n_grad), (5, n_act), (6, n_grad)):
        col = rows[:, :, field]
        col[col < 0] = discard
    return TickTable(rows.astype(np.int32), n_act, n_grad)
