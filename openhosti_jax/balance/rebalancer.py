"""`Rebalancer`: per-device microbatch counts proportional to measured speed, with hysteresis.

Counts start from the speed-proportional ideal, clipped to ``floor..capacity`` for live devices (0 for failed
ones; ``floor=0`` lets a very slow device drop to no work) by water-filling (a bisection on the proportionality
constant), rounded down; the rest go one at a time where they finish soonest. A new assignment replaces the
current one only when it shortens the predicted step time (``max_i n_i / speed_i``) by more than
``hysteresis``, so noise does not make counts oscillate. Pure numpy in float64 with index tie-breaks: every
process given the same speeds computes the same counts.
Example:
    >>> from openhosti_jax.balance import Rebalancer
    >>> rb = Rebalancer(total=28, size=4, capacity=12)
    >>> rb.assign([1.0, 1.0, 1.0, 0.5])
    (8, 8, 8, 4)
    >>> rb.update((7, 7, 7, 7), [1.0, 1.0, 1.02, 0.99])
    (7, 7, 7, 7)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from openhosti_jax.errors import BalanceError


@dataclass(frozen=True)
class Rebalancer:
    """Turns per-device speeds into integer microbatch counts for one step."""

    total: int
    """Microbatches per step (the sum of the counts)."""
    size: int
    """Data-parallel devices."""
    capacity: int
    """Buffer slots per device: the most microbatches one device can take."""
    hysteresis: float = 0.05
    """Adopt a new assignment only if its predicted step time is this fraction below the current one's."""
    floor: int = 1
    """The fewest microbatches a live device gets: 1 keeps every device measured; 0 lets a device whose share
    rounds to nothing drop out (`Balancer` retries it now and then so it can come back)."""
    synced: bool = False
    """Price a step whose devices synchronise every microbatch (``gather="microbatch"``): its time is
    ``sum_j max_{i: n_i > j} 1 / speed_i`` rather than ``max_i n_i / speed_i``."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("total", "size", "capacity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                problems.append(f"{name}={v!r} (expected an int >= 1)")
        if self.floor not in (0, 1):
            problems.append(f"floor={self.floor!r} (expected 0 or 1)")
        if not 0.0 <= self.hysteresis < 1.0:
            problems.append(f"hysteresis={self.hysteresis!r} (expected 0 <= h < 1)")
        if not problems and self.size * self.capacity < self.total:
            problems.append(
                f"size*capacity={self.size * self.capacity} < total={self.total}: raise capacity to at least "
                f"{-(-self.total // self.size)} (2x that leaves room to rebalance)"
            )
        if not problems and self.floor and self.total < self.size:
            problems.append(f"total={self.total} < size={self.size}: every live device needs >= 1 microbatch")
        if problems:
            raise BalanceError("invalid Rebalancer: " + "; ".join(problems))

    def even(self) -> tuple[int, ...]:
        """Equal split (the first ``total % size`` devices get one more)."""
        q, r = divmod(self.total, self.size)
        return tuple(q + (i < r) for i in range(self.size))

    def _bounds(self, failed: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        bad = [f for f in failed if not 0 <= f < self.size]
        if bad:
            raise BalanceError(f"failed devices {bad} are outside 0..{self.size - 1}")
        lo, hi = np.full(self.size, self.floor, np.int64), np.full(self.size, self.capacity, np.int64)
        lo[list(failed)] = hi[list(failed)] = 0
        if not lo.sum() <= self.total <= hi.sum():
            raise BalanceError(
                f"cannot place {self.total} microbatches on {self.size - len(set(failed))} live devices with "
                f"{self.floor}..{self.capacity} each; raise capacity or lower the step's microbatches"
            )
        return lo, hi

    def _speeds(self, speeds: Sequence[float], failed: Sequence[int]) -> np.ndarray:
        s = np.asarray(speeds, np.float64)
        live = np.ones(self.size, bool)
        live[list(failed)] = False
        if s.shape != (self.size,) or not (np.isfinite(s[live]) & (s[live] > 0)).all():
            raise BalanceError(
                f"expected {self.size} finite positive speeds (microbatches per second) for live devices, "
                f"found {np.asarray(speeds).tolist()}; use Monitor.speeds after at least one probe"
            )
        return np.where(live, s, 0.0)

    def ideal(self, speeds: Sequence[float], failed: Sequence[int] = ()) -> np.ndarray:
        """Real-valued counts ``clip(lam * speed, lo, hi)`` with ``lam`` chosen so that they sum to total."""
        lo, hi = self._bounds(failed)
        s = self._speeds(speeds, failed)
        fill = lambda lam: np.clip(lam * s, lo, hi)
        a, b = 0.0, self.capacity / s[s > 0].min()  # fill(b) is all hi >= total
        for _ in range(200):  # bisection on the proportionality constant: sum(fill) is monotone in it
            mid = 0.5 * (a + b)
            a, b = (mid, b) if fill(mid).sum() < self.total else (a, mid)
        return fill(b)

    def assign(self, speeds: Sequence[float], failed: Sequence[int] = ()) -> tuple[int, ...]:
        """`ideal` rounded down, then each remaining microbatch to the device that would finish it soonest (the
        smallest ``(n_i + 1) / speed_i``; ties go to the lower index): the shortest predicted step time."""
        lo, hi = self._bounds(failed)
        s = self._speeds(speeds, failed)
        n = np.clip(np.floor(self.ideal(speeds, failed) + 1e-9).astype(np.int64), lo, hi)
        for _ in range(self.total - int(n.sum())):
            open_ = [i for i in range(self.size) if n[i] < hi[i] and s[i] > 0]
            n[min(open_, key=lambda i: ((n[i] + 1) / s[i], i))] += 1
        return self._improve(n, speeds, failed, lo, hi) if self.synced else tuple(int(v) for v in n)

    def _improve(self, n: np.ndarray, speeds: Sequence[float], failed: Sequence[int], lo, hi) -> tuple[int, ...]:
        """Synced pricing: the best of the plain assignment and those that idle the k slowest devices, then single
        microbatch moves while one shortens the predicted step (a local search)."""
        plain = dataclasses.replace(self, synced=False)
        candidates = [n]
        if self.floor == 0:
            s = self._speeds(speeds, failed)
            slowest = [int(i) for i in np.argsort(s, kind="stable") if s[i] > 0]
            for k in range(1, len(slowest)):
                try:
                    candidates.append(np.asarray(plain.assign(speeds, [*failed, *slowest[:k]]), np.int64))
                except BalanceError:  # the rest cannot hold the step
                    break
        n = min(candidates, key=lambda c: self.predicted_time(c, speeds, failed))
        best = self.predicted_time(n, speeds, failed)
        while True:
            moves = []
            for a in range(self.size):
                for b in range(self.size):
                    if a != b and n[a] > lo[a] and n[b] < hi[b]:
                        m = n.copy()
                        m[a], m[b] = m[a] - 1, m[b] + 1
                        moves.append((self.predicted_time(m, speeds, failed), a, b, m))
            if not moves or min(moves, key=lambda x: x[:3])[0] >= best * (1 - 1e-12):
                return tuple(int(v) for v in n)
            best, _, _, n = min(moves, key=lambda x: x[:3])

    def predicted_time(self, counts: Sequence[int], speeds: Sequence[float], failed: Sequence[int] = ()) -> float:
        """``max_i counts_i / speed_i`` (synced: ``sum_j max_{i: n_i > j} 1 / speed_i``): the step time of ``counts``
        at ``speeds`` (inf if infeasible)."""
        s = self._speeds(speeds, failed)
        c = np.asarray(counts, np.float64)
        if (c[s == 0] > 0).any():
            return float("inf")
        live = s > 0
        if not self.synced:
            return float(np.max(c[live] / s[live]))
        c, t = c[live], 1.0 / s[live]  # iteration j lasts as long as the slowest device still busy in it
        order = np.argsort(-c, kind="stable")
        c, slowest = c[order], np.maximum.accumulate(t[order])
        return float(np.sum((c - np.append(c[1:], 0.0)) * slowest))

    def update(self, current: Sequence[int], speeds: Sequence[float], failed: Sequence[int] = ()) -> tuple[int, ...]:
        """`assign`, unless ``current`` is valid and within ``hysteresis`` of it in predicted step time."""
        new = self.assign(speeds, failed)
        cur = np.asarray(current, np.int64)
        lo, hi = self._bounds(failed)
        valid = cur.shape == (self.size,) and cur.sum() == self.total and ((cur >= lo) & (cur <= hi)).all()
        if not valid:
            return new
        t_cur = self.predicted_time(cur, speeds, failed)
        t_new = self.predicted_time(new, speeds, failed)
        return new if t_new < (1.0 - self.hysteresis) * t_cur else tuple(int(v) for v in cur)


def describe_assignment(counts: Sequence[int]) -> str | None:
    """``"mb/device 9/9/8/2"`` when the counts are uneven (for a progress line), else None."""
    counts = [int(c) for c in counts]
    return None if max(counts) - min(counts) <= 1 else "mb/device " + "/".join(map(str, counts))
