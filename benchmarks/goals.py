"""The benchmarks' goals, read from the one table that states them: ``benchmarks/README.md``.

Each script ends with ``goals.emit(out, __file__)``: it prints ``out`` as one JSON object on its last line, with
``goals`` (each of the script's keys and its goal, from the table), ``goals_met`` (whether each printed value meets
its goal; ``null`` where the goal is only reported) and ``missing_keys`` (keys the table lists for the script that
``out`` lacks). ``tests/test_benchmarks.py`` runs every script's quick mode and fails when a key is missing or a
goal the table marks as asserted in CI is not met.

A goal is one of: ``<= x``, ``< x``, ``>= x``, ``> x``, ``x`` (equal, within 1e-9), ``a-b`` (inclusive range),
``x +- d``, ``true``, ``false``, ``<= other_key`` (compared with another printed value), ``reported`` (printed,
not judged), and ``each GOAL`` for a list of values. A table key may end in ``*`` to name every printed key with
that prefix (published runs, one key each).

Example:
    >>> meets(0.3, "<= 0.35"), meets([0.95, 1.2], "each 0.9-1.1"), meets(1.005, "1.0 +- 0.01")
    (True, False, True)
    >>> meets(5, "<= bound", {"bound": 6}), meets(True, "true"), meets(3.0, "reported")
    (True, True, None)
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import sys
from typing import Any, NamedTuple

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
QUICK = "--quick" in sys.argv
"""Whether the script runs its quick mode (smaller shapes and repetitions, the same code paths): CI runs it."""
os.environ.setdefault("OPENHOSTI_RECALIBRATE", "1")
"""A benchmark prices against this machine as it is now: it measures a new device profile rather than read one
cached by an earlier run under another load (`openhosti_jax.planner.profile_cache`; set it to 0 to read it)."""


class Goal(NamedTuple):
    """One row of the table."""

    script: str
    key: str
    goal: str
    asserted: bool
    """Whether CI asserts it (deterministic goals); timing goals are printed and reported."""


def table(path: str = README) -> list[Goal]:
    """The goal rows of ``path``'s table (``| script | key | goal | CI | meaning |``)."""
    rows = []
    for line in open(path, encoding="utf-8"):
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].endswith(".py"):
            continue
        script, key, goal, ci, _ = cells
        rows.append(Goal(script, key, goal, ci.lower().startswith("asserted")))
    return rows


def _number(text: str, values: dict[str, Any]) -> float:
    text = text.strip()
    return float(values[text]) if text in values else float(text)


def meets(value: Any, goal: str, values: dict[str, Any] | None = None) -> bool | None:
    """Whether ``value`` meets ``goal`` (None: the goal is only reported)."""
    values = values or {}
    goal = goal.strip()
    if goal == "reported":
        return None
    if goal.startswith("each "):
        results = [meets(v, goal[5:], values) for v in value]
        return all(results) and bool(results)
    if goal in ("true", "false"):
        return value is (goal == "true")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    for op in ("<=", ">=", "<", ">"):
        if goal.startswith(op):
            bound = _number(goal[len(op) :], values)
            return bool({"<=": value <= bound, ">=": value >= bound, "<": value < bound, ">": value > bound}[op])
    if "+-" in goal:
        centre, tol = (float(x) for x in goal.split("+-"))
        return bool(abs(value - centre) <= tol + 1e-12)
    match = re.fullmatch(r"(-?[\d.]+)\s*-\s*(-?[\d.]+)", goal)
    if match:
        return bool(float(match[1]) <= value <= float(match[2]))
    return bool(abs(value - _number(goal, values)) <= 1e-9)


def check(out: dict[str, Any], script: str, rows: list[Goal] | None = None) -> dict[str, Any]:
    """``goals``, ``goals_met`` and ``missing_keys`` of ``out`` for ``script`` (a file name such as
    ``"memory.py"``)."""
    goals, met, missing = {}, {}, []
    for row in rows if rows is not None else table():
        if row.script != script:
            continue
        keys = fnmatch.filter(out, row.key) if "*" in row.key else [row.key] if row.key in out else []
        if not keys:
            missing.append(row.key)
        for key in keys:
            goals[key] = row.goal + ("" if row.asserted else " (reported)")
            met[key] = meets(out[key], row.goal, out)
    return {"goals": goals, "goals_met": met, "missing_keys": missing}


def emit(out: dict[str, Any], file: str) -> None:
    """Print ``out`` with its goals (`check`) as one JSON object on the last line."""
    out = {**out, "quick": QUICK, **check(out, os.path.basename(file))}
    print(json.dumps(out, default=float))
