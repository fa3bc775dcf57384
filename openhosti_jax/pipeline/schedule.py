"""Pipeline schedules as data: for each stage, the ordered forward / backward actions it runs.

Chunk ``c = virtual_stage * num_stages + stage`` of the model lives on ``stage`` (Megatron's interleaved
layout); without virtual stages chunk == stage.

Example:
    >>> print(one_f_one_b(num_stages=2, num_microbatches=3))
    Schedule 1f1b: S=2, M=3, V=1
      stage 0: F0 F1 B0 F2 B1 B2
      stage 1: F0 B0 F1 B1 F2 B2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from openhosti_jax.errors import PipelineError


@dataclass(frozen=True)
class Action:
    """One unit of work on a stage: the forward or backward pass of one microbatch through one chunk."""

    kind: Literal["F", "B"]
    """``"F"`` forward, ``"B"`` backward."""
    microbatch: int
    """Microbatch index in ``[0, M)``."""
    virtual_stage: int = 0
    """Which of the stage's chunks (``[0, V)``)."""

    def __str__(self) -> str:
        v = f".{self.virtual_stage}" if self.virtual_stage else ""
        return f"{self.kind}{self.microbatch}{v}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered actions. Validated: every (microbatch, chunk) gets one F then one B on its stage."""

    name: str
    """Human-readable schedule name."""
    num_stages: int
    """S, the devices along the ``stage`` mesh axis."""
    num_microbatches: int
    """M."""
    num_virtual: int
    """V, chunks per stage (1 unless interleaved)."""
    actions: tuple[tuple[Action, ...], ...]
    """``actions[stage]`` in execution order."""

    def __post_init__(self) -> None:
        s, m, v = self.num_stages, self.num_microbatches, self.num_virtual
        if min(s, m, v) < 1:
            raise PipelineError(f"expected S, M, V >= 1, found S={s}, M={m}, V={v}")
        if len(self.actions) != s:
            raise PipelineError(f"expected actions for {s} stages, found {len(self.actions)}")
        problems = []
        for d, acts in enumerate(self.actions):
            seen: set[tuple[str, int, int]] = set()
            for a in acts:
                key = (a.kind, a.microbatch, a.virtual_stage)
                if a.kind not in ("F", "B") or not (0 <= a.microbatch < m and 0 <= a.virtual_stage < v):
                    problems.append(f"stage {d}: invalid action {a}")
                elif key in seen:
                    problems.append(f"stage {d}: {a} appears twice")
                elif a.kind == "B" and ("F", a.microbatch, a.virtual_stage) not in seen:
                    problems.append(f"stage {d}: {a} comes before its forward")
                seen.add(key)
            if len(seen) != 2 * m * v:
                problems.append(f"stage {d}: expected {2 * m * v} actions, found {len(seen)} distinct")
        if problems:
            raise PipelineError(f"invalid schedule {self.name!r}: " + "; ".join(problems[:10]))

    @property
    def num_chunks(self) -> int:
        """S * V model chunks."""
        return self.num_stages * self.num_virtual

    def chunk(self, stage: int, action: Action) -> int:
        """Global chunk index of ``action`` run on ``stage``."""
        return action.virtual_stage * self.num_stages + stage

    def __str__(self) -> str:
        head = f"Schedule {self.name}: S={self.num_stages}, M={self.num_microbatches}, V={self.num_virtual}"
        rows = [f"  stage {d}: " + " ".join(map(str, acts)) for d, acts in enumerate(self.actions)]
        return "\n".join([head, *rows])


def _check(num_stages: int, num_microbatches: int) -> None:
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(v, int) or v < 1:
            raise PipelineError(f"expected {name} to be a positive int, found {v!r}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe): every stage keeps all M microbatches' inputs."""
    _check(num_stages, num_microbatches)
    m = num_microbatches
    per_stage = tuple(
        (*(Action("F", i) for i in range(m)), *(Action("B", i) for i in range(m))) for _ in range(num_stages)
    )
    return Schedule("gpipe", num_stages, m, 1, per_stage)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): ``S - s - 1`` warm-up forwards, then alternate: at most ``S - s`` in flight. Needs
    ``M >= S`` (with fewer microbatches the first stage never reaches its steady state: that is GPipe)."""
    _check(num_stages, num_microbatches)
    s, m = num_stages, num_microbatches
    if m < s:
        raise PipelineError(
            f"1F1B needs at least as many microbatches as stages to reach its one-forward-one-backward steady state, "
            f"found M={m} < S={s}; use M >= {s} (4S = {4 * s} keeps the bubble near 20%) or gpipe({s}, {m})"
        )
    per_stage = []
    for d in range(s):
        warm = min(s - d - 1, m)
        acts = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warm, m)]
        per_stage.append(tuple(acts))
    return Schedule("1f1b", s, m, 1, tuple(per_stage))


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, num_virtual: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): V chunks per stage shrink the bubble by ~V. Needs ``M % S == 0``."""
    _check(num_stages, num_microbatches)
    if not isinstance(num_virtual, int) or num_virtual < 1:
        raise PipelineError(f"expected num_virtual to be a positive int, found {num_virtual!r}")
    s, m, v = num_stages, num_microbatches, num_virtual
    if v == 1:
        return one_f_one_b(s, m)
    if m % s:
        raise PipelineError(
            f"interleaved 1F1B needs num_microbatches divisible by num_stages, found M={m}, S={s}; "
            f"use M={(m // s + 1) * s}"
        )

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group, pos = divmod(k, s * v)
        chunk = pos // s
        return group * s + pos % s, (v - 1 - chunk) if backward else chunk

    total = m * v
    per_stage = []
    for d in range(s):
        warm = min((s - d - 1) * 2 + (v - 1) * s, total)
        acts = [Action("F", *unit(k, False)) for k in range(warm)]
        for i in range(total - warm):
            acts += [Action("F", *unit(warm + i, False)), Action("B", *unit(i, True))]
        acts += [Action("B", *unit(k, True)) for k in range(total - warm, total)]
        per_stage.append(tuple(acts))
    return Schedule("interleaved-1f1b", s, m, v, tuple(per_stage))


def make_schedule(kind: str, num_stages: int, num_microbatches: int, num_virtual: int = 1) -> Schedule:
    """``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` by name."""
    if kind == "gpipe":
        return gpipe(num_stages, num_microbatches)
    if kind == "1f1b":
        return one_f_one_b(num_stages, num_microbatches)
    if kind == "interleaved":
        return interleaved_one_f_one_b(num_stages, num_microbatches, num_virtual)
    raise PipelineError(f"unknown schedule {kind!r}; expected 'gpipe', '1f1b' or 'interleaved'")
