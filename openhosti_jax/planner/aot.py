"""A plan checked where it will run: the step compiled ahead of time for a TPU target that is not attached
(`openhosti_jax.mesh.topology`), its compiled bytes per device beside the predicted ones, and whether the compiler
says it fits.

What counts as the compiled bytes is what the compiler holds the program to: on TPU the peak of its heap
simulation, ``memory_analysis().peak_memory_in_bytes`` (arguments, outputs and live temporaries at the worst
point). XLA:TPU's ``temp_size_in_bytes`` is not that peak: Llama-3 8B's step at 32 sequences of 1024 per v5p chip
reports 113 GiB of temporaries and compiles on a 95 GiB chip, its peak 67 GiB; at 48 it is refused with
``RESOURCE_EXHAUSTED``. A refused program is read as not fitting, with the bytes the compiler says it needed.

GPU targets cannot be compiled without a GPU attached: their checks say "forecast, not compiled".

Example:
    >>> check = CompiledCheck("v5p-128", "fsdp=64 zero3", 12 * 2**30, 10 * 2**30, 95 * 2**30, True)
    >>> round(check.predicted_over_compiled, 2), check.status
    (1.2, 'compiled')
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from openhosti_jax.errors import CompileError, OpenhostiError
from openhosti_jax.mesh.config import AXES
from openhosti_jax.mesh.topology import GENERATIONS, TpuTarget, is_tpu_target, target_mesh, torus_shape, tpu_target
from openhosti_jax.planner.profiles import PROFILES
from openhosti_jax.planner.verify import lower_step
from openhosti_jax.planner.workload import Workload
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.zero import Optimizer
from openhosti_jax.state.contracts import StepFn
from openhosti_jax.state.jit import memory_bytes, memory_stats

FORECAST = "forecast, not compiled"
"""What a check says where nothing could compile the plan (a GPU target with no GPU attached)."""

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass(frozen=True)
class CompiledCheck:
    """One plan compiled (or refused) for a target."""

    target: str
    """The target's name (``"v5p-128"``)."""
    candidate: str
    """The plan, as the planner labels it."""
    predicted_bytes: float
    """The cost model's bytes per device."""
    compiled_bytes: int | None
    """The compiler's peak bytes per device; for a refused program the bytes it said it needed; None: not
    compiled."""
    budget: int | None
    """The device's memory (the compiler's limit)."""
    fits: bool | None
    """Whether the compiler accepted the program within the device's memory; None: not compiled."""
    seconds: float = 0.0
    """Wall time of the compile."""
    message: str = ""
    """The compiler's words where it refused the program."""
    stats: dict[str, int] | None = None
    """``memory_analysis()``'s fields (argument, output, temp, alias, peak) where it compiled."""

    @property
    def status(self) -> str:
        """``"compiled"``, ``"refused: out of memory"`` or `FORECAST`."""
        if self.fits is None:
            return FORECAST
        return "compiled" if self.fits else "refused: out of memory"

    @property
    def predicted_over_compiled(self) -> float | None:
        """Predicted over compiled bytes (None where nothing compiled or nothing was predicted)."""
        return self.predicted_bytes / self.compiled_bytes if self.compiled_bytes and self.predicted_bytes else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        gib = 2**30
        return {
            "target": self.target,
            "candidate": self.candidate,
            "status": self.status,
            "fits": self.fits,
            "predicted_gib": self.predicted_bytes / gib,
            "compiled_gib": None if self.compiled_bytes is None else self.compiled_bytes / gib,
            "budget_gib": None if self.budget is None else self.budget / gib,
            "predicted_over_compiled": self.predicted_over_compiled,
            "compile_seconds": self.seconds,
            **({"compiler": self.message} if self.message else {}),
        }


def cluster_target(where: Any) -> TpuTarget | None:
    """The TPU target a cluster (or a name) is, else None: a slice name, or a `Cluster` of a TPU profile (its
    hosts the slices, each an ICI domain of ``devices_per_host`` chips).

    >>> from openhosti_jax.planner.cluster import cluster
    >>> cluster_target(cluster("2xv5p-256")).name, cluster_target("v6e-64").name, cluster_target("8xH100")
    ('2xv5p-256', 'v6e-64', None)
    """
    if isinstance(where, TpuTarget):
        return where
    if isinstance(where, str):
        return tpu_target(where) if is_tpu_target(where) else None
    profile = getattr(where, "profile", None)
    generation = next(
        (g for g, (_, _, name) in GENERATIONS.items() if profile is not None and name == profile.name), None
    )
    if generation is None:
        return None
    return TpuTarget(generation, torus_shape(generation, where.devices_per_host), where.hosts)


def required_bytes(message: str) -> int | None:
    """The bytes a ``RESOURCE_EXHAUSTED`` message says the program needed (None when it says none).

    >>> required_bytes("RESOURCE_EXHAUSTED: ... HLO temporaries (97.30G) exceeds available HBM (95.74G).")
    104475079475
    """
    m = re.search(r"(?:temporaries|required|needs?)[^(]*\(([\d.]+)\s*([KMGT]?)i?B?\)", message)
    return int(float(m[1]) * _UNITS[m[2]]) if m else None


def out_of_memory(error: BaseException) -> bool:
    """Whether a compile failed because the program does not fit the device's memory."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "exceeds available" in text


def compile_check(
    lowered: jax.stages.Lowered,
    target: TpuTarget | str,
    candidate: str,
    *,
    predicted_bytes: float = 0.0,
    budget: int | None = -1,
) -> CompiledCheck:
    """``lowered`` compiled: the compiler's peak bytes per device and whether it accepted the program within
    ``budget`` (default: one chip of ``target``; None: no limit but the compiler's). Raises `CompileError` (the
    compiler's message kept, ``candidate`` named) for a failure that is not memory."""
    t = tpu_target(target)
    budget = chip_bytes(t) if budget == -1 else budget
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # the compiler's refusal: memory is an answer, anything else an error
        if not out_of_memory(e):
            raise CompileError(
                f"compiling {candidate} for {t.name} failed for a reason other than memory; the compiler said: "
                f"{str(e)[:2000]}"
            ) from e
        seconds = time.perf_counter() - start
        return CompiledCheck(t.name, candidate, predicted_bytes, required_bytes(str(e)), budget, False, seconds, str(e))
    peak, seconds = memory_bytes(compiled), time.perf_counter() - start
    fits = None if peak is None else budget is None or peak <= budget
    return CompiledCheck(t.name, candidate, predicted_bytes, peak, budget, fits, seconds, "", memory_stats(compiled))


def chip_bytes(target: TpuTarget | str) -> int | None:
    """The HBM of one chip of ``target`` (its device profile's)."""
    return PROFILES[tpu_target(target).profile_name].memory_bytes


def compile_on_target(
    plan: ShardingPlan,
    work: Workload,
    tx: Optimizer,
    step_fn: StepFn,
    target: TpuTarget | str,
    *,
    predicted_bytes: float = 0.0,
    candidate: str = "",
    budget: int | None = -1,
) -> CompiledCheck:
    """``step_fn`` under ``plan`` compiled for ``target`` from abstract state and batch (nothing is allocated)
    (`compile_check`). Raises `MeshConfigError` where the plan's mesh does not fit the target, `MissingExtraError`
    without libtpu, `CompileError` for a failure that is not memory."""
    t = tpu_target(target)
    mesh = target_mesh(t, dict(plan.mesh_shape), AXES)
    label = candidate or _label(plan)
    lowered = lower_for(lambda: lower_step(plan, work, tx, step_fn, mesh), t, label)
    return compile_check(lowered, t, label, predicted_bytes=predicted_bytes, budget=budget)


def lower_for(lower: Callable[[], jax.stages.Lowered], target: TpuTarget, candidate: str) -> jax.stages.Lowered:
    """``lower()``, a failure to lower for the target's platform (an op it has no rule for, e.g. ``eig`` on TPU)
    raised as `CompileError` with the lowering's words and ``candidate`` named; the library's own typed errors
    pass as they are."""
    try:
        return lower()
    except OpenhostiError:
        raise
    except Exception as e:  # noqa: BLE001 - jax raises NotImplementedError, ValueError, JaxRuntimeError here
        raise CompileError(
            f"lowering {candidate} for {target.name} failed ({type(e).__name__}); the step uses something the "
            f"target's platform cannot run. It said: {str(e)[:2000]}"
        ) from e


def target_compiler(
    work: Workload,
    tx: Optimizer,
    step_fn: StepFn,
    target: TpuTarget | str,
    checks: list[CompiledCheck] | None = None,
    describe: Callable[[ShardingPlan], tuple[str, float]] | None = None,
) -> Callable[[ShardingPlan], int | None]:
    """``compiled_bytes(plan)`` for the planner's verify stage (`openhosti_jax.planner.search.first_that_compiles_
    within`) on ``target``: the compiler's peak bytes, or for a refused program the bytes it said it needed (over
    any budget: a refused plan is never taken as fitting). Each check is appended to ``checks``; ``describe(plan)``
    gives its candidate label and predicted bytes."""

    def compiled_bytes(plan: ShardingPlan) -> int | None:
        label, predicted = describe(plan) if describe is not None else ("", 0.0)
        check = compile_on_target(
            plan, work, tx, step_fn, target, predicted_bytes=predicted, candidate=label, budget=None
        )
        if checks is not None:
            checks.append(check)
        if check.fits is False:  # refused: more than the chip holds, at least what the compiler said it needed
            return max(check.compiled_bytes or 0, (chip_bytes(target) or 0) + 1)
        return check.compiled_bytes

    return compiled_bytes


def _label(plan: ShardingPlan) -> str:
    mesh = " ".join(f"{a}={n}" for a, n in plan.mesh_shape.items() if n > 1) or "1 device"
    return f"{mesh} zero{plan.zero_stage} remat={plan.remat} {plan.precision}"
