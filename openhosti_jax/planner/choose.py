"""`choose_plan`: choose mesh shape, ZeRO stage and per-leaf specs for a model from abstract shapes, then verify.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from openhosti_jax.planner import choose_plan
    >>> p, report = choose_plan(nnx.Linear(512, 512, rngs=nnx.Rngs(0)), optax.adam(1e-3),
    ...                         jax.ShapeDtypeStruct((64, 512), jnp.float32), verify=False, device_profile="H100")
    >>> sorted(p.mesh_shape) == ["context", "data", "expert", "fsdp", "stage", "tensor"], report.plan is p
    (True, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from openhosti_jax.errors import PlanningError
from openhosti_jax.mesh.build import build_mesh
from openhosti_jax.mesh.config import MeshConfig
from openhosti_jax.planner.aot import FORECAST, CompiledCheck, chip_bytes, cluster_target, target_compiler
from openhosti_jax.planner.calibrate import device_profile as resolve_profile
from openhosti_jax.planner.cluster import Cluster
from openhosti_jax.planner.cluster import cluster as resolve_cluster
from openhosti_jax.planner.profiles import PROFILES, DeviceProfile
from openhosti_jax.planner.prune import pruned_search
from openhosti_jax.planner.refine import MEASURED_TIE, measured_order, time_plans
from openhosti_jax.planner.search import (
    context_sizes,
    enumerate_candidates,
    expert_count,
    expert_sizes,
    first_that_compiles_within,
    gradient_bytes,
    memory_budget_for,
    precision_options,
    rank,
    remat_options,
    report_for,
    search,
    variants_of,
    why,
)
from openhosti_jax.planner.stacks import STACKS
from openhosti_jax.planner.verify import compiled_step_bytes, default_step, step_accumulates
from openhosti_jax.planner.workload import workload
from openhosti_jax.policies.fp8 import device_fp8_problem, fp8_problem
from openhosti_jax.policies.remat import REMAT_POLICIES
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import PlanReport
from openhosti_jax.sharding.rules import DEFAULT_RULES, Rules

REFINE_TIMING = {"steps": 4, "rounds": 6}
"""Steps per round and alternated rounds `time_plans` runs for each candidate ``refine`` times."""


def fp8_refusal(devices: Sequence[jax.Device], profile: DeviceProfile) -> str | None:
    """Why precision ``"fp8"`` cannot be chosen for ``devices`` (the first's backend, `device_fp8_problem`), or for
    a cluster that is not attached (its ``profile``: a TPU's, or one with no fp8 rate); None where it can."""
    if devices:
        return device_fp8_problem(devices[0])
    tpu = profile.name.startswith("TPU")
    if tpu or profile.fp8_flops is None:
        rated = [n for n, p in PROFILES.items() if p.fp8_flops and not n.startswith("TPU")]
        problem = fp8_problem("tpu" if tpu else "gpu", profile.name)
        return f"{problem} (profiles with an fp8 rate it runs on: {', '.join(rated)})"
    return None


def choose_plan(
    init_fn_or_model: Any,
    optimizer: optax.GradientTransformation,
    sample_batch: Any,
    devices: Sequence[jax.Device] | None = None,
    memory_budget: int | None = None,
    *,
    step_fn: Callable | None = None,
    pipeline: bool = False,
    verify: bool = True,
    device_profile: DeviceProfile | str | None = None,
    rules: Rules = DEFAULT_RULES,
    apply_fn: Callable | None = None,
    refine: int = 0,
    remat: str | Sequence[str] = "auto",
    precision: str | Sequence[str] = "fp32",
    cluster: Cluster | str | None = None,
    accumulate: bool | None = None,
    compile: bool = False,
    exhaustive: bool = False,
) -> tuple[ShardingPlan, PlanReport]:
    """(plan, report): the best `ShardingPlan` for training ``init_fn_or_model`` with ``optimizer`` on ``devices``.

    ``init_fn_or_model``: an ``nnx.Module``, a linen module (initialised on ``sample_batch``) or an
    ``init_fn(rng)`` returning either. ``sample_batch``: the global batch (arrays or ShapeDtypeStructs).
    ``memory_budget``: bytes per device (default: the device profile's memory; none on CPU).
    ``step_fn(state, batch) -> (state, metrics)`` is the step compiled for verification (default: the mean
    model output as loss). ``pipeline`` adds the ``stage`` axis to the search (scored, not compiled).
    ``device_profile``: a `DeviceProfile` or a `PROFILES` name; default spec sheet or CPU calibration.
    ``refine``: compile and time the ``refine`` best predicted candidates for a few real steps and pick the
    fastest measured unless it beats the predicted winner by less than `refine.MEASURED_TIE`
    (`refine.time_plans`; needs ``verify``; the timings are listed in the report's notes).
    ``remat``: the remat policies the search may use when a plan would not fit without one (``"auto"``: every
    one the devices run; they change no result beyond rounding). ``precision``: the precisions it may use
    (``"fp32"`` by default, ``"auto"`` or names from `openhosti_jax.policies.precision.PRECISIONS`).
    ``cluster``: plan for a cluster that is not attached (a `Cluster` or a name such as ``"64xH100"`` or
    ``"v5p-128"``): its devices replace ``devices``, collectives are priced in each host and across hosts, and
    nothing is compiled (the plan is as predicted).
    ``accumulate``: whether plans may accumulate gradients over microbatches (default: where ``step_fn`` reads the
    microbatch count, as `openhosti_jax.make_train_step`'s steps do); True with a step that does not is an error.
    ``exhaustive``: score every candidate; by default a plan taken on its prediction (a ``cluster``, or nothing to
    compile) skips those that provably cannot fit or win (`openhosti_jax.planner.prune`: the same winner), and
    one that is compiled or timed scores them all (the next ones by rank are its fallbacks).
    Raises `MemoryBudgetError` when nothing fits, naming the smallest achievable memory.
    """
    if not isinstance(refine, int) or refine < 0:
        raise PlanningError(f"refine must be an int >= 0 (candidates to time), found {refine!r}; use 0 to skip")
    work = workload(init_fn_or_model, sample_batch, apply_fn=apply_fn)
    target = None
    if cluster is not None:
        where = resolve_cluster(cluster)
        if compile:
            target = cluster_target(where)
        if device_profile is not None:
            chosen = PROFILES[device_profile] if isinstance(device_profile, str) else device_profile
            where = dataclasses.replace(where, profile=chosen)
        profile, n_devices, verify, refine = where.profile, where.n_devices, False, 0
        budget = memory_budget if memory_budget is not None else profile.memory_bytes
        source = "given" if memory_budget is not None else f"the {profile.name} spec sheet"
        remats = REMAT_POLICIES if remat == "auto" else (remat,) if isinstance(remat, str) else tuple(remat)
        devices = []
    else:
        devices = list(devices or jax.devices())
        profile = resolve_profile(devices, device_profile, max_bytes=gradient_bytes(work))
        where, n_devices, remats = profile, len(devices), remat_options(remat, devices)
        budget, source = memory_budget_for(devices, profile, memory_budget)
    software = where.stack if isinstance(where, Cluster) else STACKS["openhosti"]
    precisions = precision_options(precision)
    if "fp8" in precisions and (problem := fp8_refusal(devices, profile)):
        raise PlanningError(problem)
    candidates = enumerate_candidates(
        n_devices,
        pipeline=pipeline,
        precisions=precisions,
        max_tensor=where.devices_per_host if isinstance(where, Cluster) and where.hosts > 1 else None,
        max_stages=work.layer_count,
        pipeline_tensor=software.pipeline_tensor,
        pipeline_context=software.pipeline_context,
        pipeline_expert=software.pipeline_expert,
        sequence_parallel=profile.native_reduce_scatter,
        context=context_sizes(work, n_devices, where.devices_per_host if isinstance(where, Cluster) else n_devices),
        expert=expert_sizes(
            expert_count(work), n_devices, where.devices_per_host if isinstance(where, Cluster) else n_devices
        ),
    )
    reads_count = step_fn is not None and step_accumulates(work, optimizer, step_fn)
    if accumulate and step_fn is not None and not reads_count:
        raise PlanningError(
            "accumulate=True offers plans that accumulate gradients over microbatches, but the step_fn given does "
            "not read the microbatch count; build it with openhosti_jax.make_train_step, or leave accumulate unset"
        )
    accumulates = reads_count if accumulate is None else accumulate
    can_compile = verify and (step_fn is not None or work.apply_fn is not None)
    pruned = not (exhaustive or can_compile or target is not None)  # compiled plans fall back on the next by rank
    scored = (pruned_search if pruned else search)(
        work, optimizer, candidates, where, rules=rules, memory_budget=budget, remats=remats, accumulates=accumulates
    )
    ranked = rank(scored, budget)
    notes = list(why(ranked, scored, budget))
    if pruned:
        notes.append("pruned: candidates that provably cannot fit or win were not scored (exhaustive=True scores all)")
    notes.append(f"device profile: {profile.name}; memory budget: {source}")
    if isinstance(where, Cluster) and target is None:
        notes.append(
            f"cluster: {where.hosts} host(s) x {where.devices_per_host} {profile.name}, not attached: "
            + (f"{FORECAST} (a GPU target compiles only where its GPUs are attached)" if compile else FORECAST)
        )
    if work.apply_fn is None:
        notes.append("no apply function: activations and FLOPs unknown, chosen on state memory and traffic")
    winner, compiled = ranked[0], None
    top = []
    if refine and can_compile:
        top = [s for s in ranked[:refine] if s.plan.pipeline_stages == 1]
        if not top:
            notes.insert(0, f"refined: none of the top {refine} predicted is unpipelined, so none was timed")
    if top:
        measured = time_plans(
            [s.plan for s in top], work, optimizer, step_fn or default_step, devices, sample_batch, **REFINE_TIMING
        )
        by_time = [(measured[i], top[i]) for i in measured_order(measured, MEASURED_TIE)]
        ranked = [s for _, s in by_time] + [s for s in ranked if s not in top]
        notes.insert(
            0,
            f"refined: timed the top {len(top)} predicted, picked {by_time[0][1].candidate.label}; measured "
            + ", ".join(f"{s.candidate.label} {t * 1e3:.2f} ms" for t, s in by_time),
        )
    if target is not None:
        checks: list[CompiledCheck] = []
        known = {id(s.plan): s for s in ranked}
        variants = variants_of(work, optimizer, where, remats, accumulates, rules=rules)

        def expand(s: Any) -> Any:
            more = variants(s)
            known.update({id(v.plan): v for v in more})
            return more

        def describe(plan: ShardingPlan) -> tuple[str, float]:
            s = known.get(id(plan))
            return ("", 0.0) if s is None else (s.candidate.label, float(s.estimate.bytes))

        compiled_on = target_compiler(work, optimizer, step_fn or default_step, target, checks, describe)
        chip = chip_bytes(target)  # what the compiler holds a program to, whatever budget the search was given
        held = chip if budget is None or chip is None else min(budget, chip)
        winner, compiled, verified = first_that_compiles_within(ranked, compiled_on, held, expand)
        notes += verified
        notes += [
            f"{c.candidate}: compiled for {c.target} ({c.status}): {_gib(c.compiled_bytes)} per device, predicted "
            f"{_gib(c.predicted_bytes)}"
            for c in checks
        ]
    elif can_compile:

        def compiled_bytes(candidate: ShardingPlan) -> int | None:
            mesh = build_mesh(MeshConfig.from_sizes(dict(candidate.mesh_shape)), devices)
            return compiled_step_bytes(candidate, work, optimizer, step_fn or default_step, mesh)

        expand = variants_of(work, optimizer, where, remats, accumulates, rules=rules)
        winner, compiled, verified = first_that_compiles_within(ranked, compiled_bytes, budget, expand)
        notes += verified
    return winner.plan, report_for(winner, ranked, notes, work, compiled)


def _gib(nbytes: float | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"
