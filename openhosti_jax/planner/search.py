"""Search over mesh shapes x ZeRO stages, scored by the cost model; `plan_on_mesh` for a mesh fixed by the user.

Candidates factor the device count over ``data`` / ``fsdp`` / ``tensor`` (and ``stage`` when pipelining, ``expert``
for a mixture of experts: sizes that divide its expert count). ZeRO stage 0 uses ``data`` only; stages 1-3 shard
over ``fsdp`` (and ``expert``, a data axis outside the experts) and replicate over ``data`` (hybrid sharding when
both are > 1), so every candidate is a distinct placement. The winner is the fastest predicted candidate whose
predicted memory fits the budget; candidates within 1% of it count as ties (closer than the model can rank),
broken by the less recomputation (the remat policy's and, where the compiler rematerializes to fit, the
compiler's; host offload last), the fewer microbatches, the lower ZeRO stage, then the smaller tensor axis,
then the smaller predicted memory (headroom for a larger microbatch), then the predicted time. The rest follow by
predicted time. A candidate over the budget is scored again with each remat policy and microbatch count the
model and step can run (`policy_variants`), and each precision the user allows is its own candidate.

Example:
    >>> from openhosti_jax.planner.search import enumerate_candidates
    >>> [c.label for c in enumerate_candidates(2)]
    ['data=2 zero0', 'fsdp=2 zero1', 'fsdp=2 zero2', 'fsdp=2 zero3', 'tensor=2 zero0 sequence-parallel']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from openhosti_jax.errors import MemoryBudgetError, PlanningError
from openhosti_jax.mesh.build import mesh_sizes
from openhosti_jax.mesh.config import AXES
from openhosti_jax.mesh.memory import device_memory_limit
from openhosti_jax.planner.calibrate import device_profile
from openhosti_jax.planner.cluster import Cluster
from openhosti_jax.planner.cost import Estimate, estimate, kv_width
from openhosti_jax.planner.profiles import DeviceProfile
from openhosti_jax.planner.stacks import STACKS
from openhosti_jax.planner.verify import compiled_step_bytes, step_accumulates
from openhosti_jax.planner.workload import Workload, measure, measure_step
from openhosti_jax.policies.optimizers import optimizer_for
from openhosti_jax.policies.precision import PRECISIONS
from openhosti_jax.policies.remat import REMAT_POLICIES, available_remat, check_remat
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import CandidateRow, PlanReport
from openhosti_jax.sharding.rules import DEFAULT_RULES, Rules
from openhosti_jax.sharding.specs import DEFAULT_MIN_ELEMENTS, is_spec, spec_axes
from openhosti_jax.sharding.table import format_bytes
from openhosti_jax.sharding.tensor import base_specs
from openhosti_jax.sharding.zero import ZERO_AXES, Optimizer, opt_state_specs, zero_specs
from openhosti_jax.sizes import divisors, tree_bytes
from openhosti_jax.state.contracts import ApplyFn

TIE = 0.01
"""Predicted times within this fraction of the best are ties: a run-time calibration's noise can flip the order of
candidates predicted closer than this, so they are ordered by lower ZeRO stage and memory headroom instead (the
measurements behind the value are in the README's design notes)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: axis sizes, ZeRO stage and the axes ZeRO shards over."""

    mesh_shape: dict[str, int]
    """Axis name -> size, every axis of `AXES`."""
    zero_stage: int
    """0-3."""
    zero_axes: tuple[str, ...] = ZERO_AXES
    """Axes ZeRO shards state over."""
    remat: str = "none"
    """Remat policy of the model's repeated blocks."""
    precision: str = "fp32"
    """Mixed-precision policy."""
    microbatches: int = 1
    """Gradient-accumulation steps."""
    virtual: int = 1
    """Model chunks per pipeline stage: > 1 interleaves them (interleaved 1F1B)."""
    sequence_parallel: bool = False
    """Activations between blocks split along the sequence over the tensor axis (`ShardingPlan.sequence_parallel`)."""

    @property
    def label(self) -> str:
        """e.g. ``"data=2 fsdp=4 zero3"``, then the policies that are not the default (``"remat=full"``)."""
        axes = " ".join(f"{a}={n}" for a, n in self.mesh_shape.items() if n > 1) or "1 device"
        extra = [f"remat={self.remat}"] if self.remat != "none" else []
        extra += [self.precision] if self.precision != "fp32" else []
        extra += [f"microbatches={self.microbatches}"] if self.microbatches > 1 else []
        extra += ["sequence-parallel"] if self.sequence_parallel else []
        return " ".join([f"{axes} zero{self.zero_stage}", *extra])


@dataclasses.dataclass(frozen=True, eq=False)
class Scored:
    """A candidate with its plan and predicted cost."""

    candidate: Candidate
    plan: ShardingPlan
    estimate: Estimate

    def row(self) -> CandidateRow:
        """The candidate's line in a report's ranking."""
        e = self.estimate
        return CandidateRow(self.candidate.label, e.seconds, e.bytes, e.comm_bytes)


def replicas(mesh_shape: dict[str, int]) -> int:
    """How many ways a mesh splits the batch's rows: ``data x fsdp x expert`` (`ShardingPlan.data_parallel_size`)."""
    return mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1) * mesh_shape.get("expert", 1)


def hybrid_axes(mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The axes ZeRO shards over on ``mesh_shape``: all of `ZERO_AXES`, or where ``data`` and a sharding axis
    (``fsdp`` or ``expert``) are both > 1, those of ``fsdp`` and ``expert`` that are (hybrid sharding: replicas
    over ``data``); on a pipelined mesh with an ``expert`` axis, ``fsdp`` (a stage's ZeRO,
    `openhosti_jax.pipeline.state`).

    >>> hybrid_axes({"data": 2, "fsdp": 4}), hybrid_axes({"data": 2, "expert": 8}), hybrid_axes({"fsdp": 8})
    (('fsdp',), ('expert',), ('data', 'fsdp', 'expert'))
    >>> hybrid_axes({"stage": 2, "fsdp": 2, "expert": 2})
    ('fsdp',)
    """
    if mesh_shape.get("stage", 1) > 1 and mesh_shape.get("expert", 1) > 1:
        return ("fsdp",)
    if mesh_shape.get("data", 1) > 1 and mesh_shape.get("fsdp", 1) * mesh_shape.get("expert", 1) > 1:
        return tuple(a for a in ("fsdp", "expert") if mesh_shape.get(a, 1) > 1)
    return ZERO_AXES


def expert_count(work: Workload) -> int:
    """Routed experts per mixture-of-experts layer of ``work`` (`Workload.experts`: a dim named ``"experts"``);
    0 for a dense model."""
    return work.experts().num_experts


def expert_sizes(experts: int, n_devices: int, per_host: int) -> tuple[int, ...]:
    """The ``expert`` axis sizes worth pricing: 1, and every size > 1 that divides both the expert count and the
    devices and fits in a host (its all-to-all runs every layer, over the fast links), then those that span hosts.

    >>> expert_sizes(8, 64, 8), expert_sizes(0, 64, 8), expert_sizes(64, 32, 8)
    ((1, 2, 4, 8), (1,), (1, 2, 4, 8, 16, 32))
    """
    if experts <= 1:
        return (1,)
    sizes = [e for e in divisors(n_devices) if experts % e == 0]
    return tuple(sorted(sizes, key=lambda e: (e > per_host, e)))


def enumerate_candidates(
    n_devices: int,
    *,
    pipeline: bool = False,
    tensor: bool = True,
    precisions: Sequence[str] = ("fp32",),
    max_tensor: int | None = None,
    max_stages: int | None = None,
    pipeline_tensor: bool = True,
    sequence_parallel: bool = True,
    context: Sequence[int] = (1,),
    pipeline_context: bool = True,
    expert: Sequence[int] = (1,),
    pipeline_expert: bool = False,
) -> list[Candidate]:
    """Every distinct (mesh shape, ZeRO stage) for ``n_devices``, once per precision of ``precisions``
    (``max_tensor``: the largest tensor axis, e.g. the devices of one host: a tensor-parallel group that crosses
    hosts all-reduces every layer's activations over the slow link; ``max_stages``: the most pipeline stages, the
    model's layer count; ``pipeline_tensor``: whether a pipeline stage can split its layers over ``tensor``, as
    `Stack.pipeline_tensor` says (this library's pipeline can); where it cannot, a pipelined mesh has none;
    ``sequence_parallel``: whether a tensor axis splits the sequence too, which saves memory only where the
    backend reduce-scatters natively (`DeviceProfile.native_reduce_scatter`): XLA's CPU backend all-reduces the
    block's output in full and slices it, and a sequence-split GPT step compiled there is larger, not smaller);
    ``context``: the sizes of a context axis to try (each sequence split over it, `openhosti_jax.models.context`);
    ``pipeline_context``: whether a pipelined mesh may have one too (`Stack.pipeline_context`); ``expert``: the
    sizes of an ``expert`` axis to try (`expert_sizes`; a candidate's mesh names the axis only where one is > 1),
    composed with the others; ``pipeline_expert``: whether a pipelined mesh may have one too
    (`Stack.pipeline_expert`; its ZeRO shards over ``fsdp`` alone, as the pipeline's state does)."""
    out = []
    for s in [s for s in divisors(n_devices) if max_stages is None or s <= max_stages] if pipeline else [1]:
        for t in [t for t in divisors(n_devices // s) if max_tensor is None or t <= max_tensor] if tensor else [1]:
            if s > 1 and t > 1 and not pipeline_tensor:
                continue
            for c in [c for c in context if (n_devices // (s * t)) % c == 0 and (s == 1 or c == 1 or pipeline_context)]:
                for e in [
                    e for e in expert if (n_devices // (s * t * c)) % e == 0 and (s == 1 or e == 1 or pipeline_expert)
                ]:
                    rest = n_devices // (s * t * c * e)
                    for f in divisors(rest):
                        shape = {"stage": s, "data": rest // f, "fsdp": f, "context": c, "tensor": t}
                        if max(expert) > 1:
                            shape = {"stage": s, "data": rest // f, "fsdp": f, "expert": e, "context": c, "tensor": t}
                        stages = [0] if f == 1 and e == 1 else [0, 1, 2, 3] if f == 1 else [1, 2, 3]
                        if s > 1 and e > 1:  # a stage's ZeRO is over fsdp alone (hybrid_axes)
                            stages = [0] if f == 1 else [1, 2, 3]
                        axes = hybrid_axes(shape) if e > 1 else ("fsdp",) if rest // f > 1 else ZERO_AXES
                        sequence = t > 1 and sequence_parallel  # it only saves memory: the same bytes move
                        out += [
                            Candidate(shape, z, axes, precision=p, sequence_parallel=sequence)
                            for p in precisions
                            for z in stages
                        ]
    return out


def context_sizes(work: Workload, n_devices: int, per_host: int) -> tuple[int, ...]:
    """The context axis sizes worth pricing for ``work``: 1, and where the global batch has no more sequences than
    devices (data parallelism alone leaves each device at most one sequence, which microbatches cannot cut
    further) and the model names its attention's keys and values (`openhosti_jax.planner.cost.kv_width`: the
    bundled models, whose attention runs over a context axis), each size within a host (its exchange runs every
    layer, over the fast links) that splits the sequence into twice as many equal chunks (the causal balance)."""
    tokens = work.tokens_per_example
    if work.global_batch > n_devices or tokens <= 1 or not kv_width(work)[0]:
        return (1,)
    return tuple(c for c in divisors(n_devices) if c <= per_host and tokens % (2 * c) == 0)


def _family(c: Candidate) -> tuple:
    """What a candidate shares with its remat and microbatch variants: mesh, ZeRO stage and axes, precision,
    interleaving, sequence split (the variants' specs are made once; a compiled excess holds for all of them)."""
    return (tuple(c.mesh_shape.items()), c.zero_stage, c.zero_axes, c.precision, c.virtual, c.sequence_parallel)


def collective_matmul(candidate: Candidate, profile: DeviceProfile | Cluster) -> bool:
    """Whether ``candidate``'s plan runs its projections as collective matmuls: a sequence-parallel candidate
    without a pipeline, on a stack that runs them (`Stack.collective_matmul`; attached devices run this library's)
    and devices that overlap collectives with compute (elsewhere the decomposition only adds steps)."""
    stack = profile.stack if isinstance(profile, Cluster) else STACKS["openhosti"]
    device = profile.profile if isinstance(profile, Cluster) else profile
    return (
        candidate.sequence_parallel
        and candidate.mesh_shape["stage"] == 1
        and stack.collective_matmul
        and device.overlap
    )


def score(
    work: Workload,
    tx: Optimizer,
    candidate: Candidate,
    profile: DeviceProfile | Cluster,
    *,
    rules: Rules = DEFAULT_RULES,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
    sharded_specs: Any | None = None,
    cache: dict | None = None,
) -> Scored:
    """The plan and predicted cost of one candidate (``sharded_specs``: its fully ZeRO-sharded parameter specs,
    when already known for its mesh shape; ``cache``: a dict in which the specs of candidates that differ only in
    remat policy and microbatch count are made once)."""
    candidate, plan, base, sharded, tx = plan_for(
        work, tx, candidate, profile, rules=rules, min_elements=min_elements, sharded_specs=sharded_specs, cache=cache
    )
    return Scored(candidate, plan, estimate(plan, work, tx, profile, base, sharded))


def plan_for(
    work: Workload,
    tx: Optimizer,
    candidate: Candidate,
    profile: DeviceProfile | Cluster,
    *,
    rules: Rules = DEFAULT_RULES,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
    sharded_specs: Any | None = None,
    cache: dict | None = None,
    state: bool = True,
) -> tuple[Candidate, ShardingPlan, Any, Any, Optimizer]:
    """What `score` prices for ``candidate`` (same arguments): (the candidate as planned, its plan, its base specs,
    its fully ZeRO-sharded specs, the optimizer its precision runs). ``state=False``: a plan of the specs before
    ZeRO alone and no optimizer-state specs (all that pricing its matmuls reads, `cost.matmul_seconds`)."""
    sizes = candidate.mesh_shape
    stack = profile.stack if isinstance(profile, Cluster) else STACKS["openhosti"]
    if candidate.sequence_parallel and sizes.get("context", 1) > 1 and not stack.context_sequence_parallel:
        if not collective_matmul(candidate, profile):  # the stack runs this split only with collective matmuls
            candidate = dataclasses.replace(candidate, sequence_parallel=False)
    microbatches = microbatches_of(work, candidate)
    key = _family(candidate)
    if cache is not None and key in cache:
        plan, base, sharded, tx = cache[key]
        plan = dataclasses.replace(plan, remat=candidate.remat, num_microbatches=microbatches)
        return candidate, plan, base, sharded, tx
    tx = optimizer_for(tx, candidate.precision)
    if state:
        base, sharded, opt = _mesh_specs(work, tx, candidate, rules, min_elements, sharded_specs, cache)
    else:
        base = _base(work, candidate, rules, {} if cache is None else cache)
        sharded, opt = base, None
    stage = candidate.zero_stage if state else 0
    plan = ShardingPlan(  # `ShardingPlan.from_zero`'s specs, made once per mesh shape and ZeRO axes
        {a: int(sizes.get(a, 1)) for a in AXES},
        sharded if stage >= 3 else base,
        sharded if stage >= 2 else base,
        opt,
        zero_stage=stage,
        pipeline_stages=sizes["stage"],
        remat=candidate.remat,
        precision=candidate.precision,
        num_microbatches=microbatches,
        pipeline_schedule="interleaved" if candidate.virtual > 1 else "1f1b",
        pipeline_virtual=candidate.virtual,
        sequence_parallel=candidate.sequence_parallel,
        collective_matmul=collective_matmul(candidate, profile),
    )
    if cache is not None and state:
        cache[key] = (plan, base, sharded, tx)
    return candidate, plan, base, sharded, tx


def _mesh_specs(
    work: Workload,
    tx: Optimizer,
    candidate: Candidate,
    rules: Rules,
    min_elements: int,
    sharded_specs: Any | None,
    cache: dict | None,
) -> tuple[Any, Any, Any]:
    """(base specs, fully ZeRO-sharded specs, optimizer-state specs) of ``candidate``, each made once per mesh shape
    (and ZeRO axes, and optimizer ``tx``) in ``cache``: a search's candidates share them across ZeRO stages,
    precisions and policies (``ShardingPlan.from_zero`` would derive them again for each)."""
    cache = {} if cache is None else cache
    sizes = {a: int(candidate.mesh_shape.get(a, 1)) for a in AXES}
    shape = tuple(sizes.items())
    base = _base(work, candidate, rules, cache)
    group = ("sharded", shape, id(rules), candidate.zero_axes, min_elements)
    if group not in cache:
        cache[group] = (
            sharded_specs
            if sharded_specs is not None
            else zero_specs(
                work.params, None, sizes, 3, base_specs=base, axes=candidate.zero_axes, min_elements=min_elements
            )[0]
        )
    sharded = cache[group]
    leaf = sharded if candidate.zero_stage >= 1 else base
    opt = ("opt", group, id(tx), candidate.zero_stage >= 1)
    if opt not in cache:
        cache[opt] = (tx, opt_state_specs(tx, work.params, leaf))
    return base, sharded, cache[opt][1]


def _base(work: Workload, candidate: Candidate, rules: Rules, cache: dict) -> Any:
    """``candidate``'s specs before ZeRO (`base_specs`, as a tree like the parameters), once per mesh shape."""
    sizes = {a: int(candidate.mesh_shape.get(a, 1)) for a in AXES}
    key = ("base", tuple(sizes.items()), id(rules))
    if key not in cache:
        cache[key] = (rules, jax.tree.unflatten(jax.tree.structure(work.params), base_specs(work.params, sizes, rules)))
    return cache[key][1]


def microbatches_of(work: Workload, candidate: Candidate) -> int:
    """The microbatch count of ``candidate``'s plan: its own, or a pipelined one's default (`pipeline_microbatches`)
    where it names one."""
    if candidate.mesh_shape["stage"] == 1 or candidate.microbatches > 1:
        return candidate.microbatches
    return pipeline_microbatches(work, candidate)


def pipeline_microbatches(work: Workload, candidate: Candidate) -> int:
    """The microbatch count of a pipelined candidate: 4S where the per-replica batch allows it (1F1B's bubble is
    then (S-1)/(5S-1), under 20%), else the largest multiple of S, else S (1F1B needs M >= S)."""
    s = candidate.mesh_shape["stage"]
    local = max(work.global_batch // replicas(candidate.mesh_shape), 1)
    fits = [m for m in range(4 * s, s - 1, -s) if local % m == 0]
    return fits[0] if fits else s


def _uses_tensor(scored: Scored) -> bool:
    specs = jax.tree.leaves(scored.plan.param_specs, is_leaf=is_spec)
    return any("tensor" in spec_axes(s) for s in specs)


def gradient_bytes(work: Workload) -> int:
    """Bytes of the full gradient: the largest collective a candidate issues (its combined reduction)."""
    return tree_bytes(work.params)


def policy_variants(candidate: Candidate, work: Workload, remats: Sequence[str], accumulates: bool) -> list[Candidate]:
    """``candidate`` with each remat policy in ``remats`` that the model applies and, when the step accumulates
    gradients, each power-of-two microbatch count that divides the per-device batch (a pipelined one: each count
    of S x 2^i microbatches above its default that divides the per-replica batch, and one example per microbatch);
    the plain one excluded."""
    return [
        dataclasses.replace(candidate, remat=r, microbatches=k)
        for r, k in variant_policies(candidate, work, remats, accumulates)
    ]


def variant_policies(
    candidate: Candidate, work: Workload, remats: Sequence[str], accumulates: bool
) -> list[tuple[str, int]]:
    """The (remat policy, microbatch count) of each of `policy_variants`, in its order, without making them."""
    dp, s = replicas(candidate.mesh_shape), candidate.mesh_shape["stage"]
    local = work.global_batch // dp
    if s > 1:  # a pipeline's microbatches: more of them hold fewer activations in flight (down to one example)
        counts = [m for m in (s * 2**i for i in range(local.bit_length())) if m <= local and local % m == 0]
        if local % s == 0 and local not in counts:  # one example per microbatch: the fewest activations in flight
            counts.append(local)
        counts = [1] + [m for m in counts if m > pipeline_microbatches(work, candidate)]  # 1: the default
    else:
        counts = [k for k in (2**i for i in range(local.bit_length())) if local % k == 0] if accumulates else [1]
    out = []
    for k in counts:
        for r in remats:
            if (r, k) == (candidate.remat, candidate.microbatches):
                continue
            if work.policy_activations(r, candidate.precision) is not None:
                out.append((r, k))
    return out


def _own_factor(work: Workload, c: Candidate) -> float:
    """The recompute factor ``c``'s remat policy costs by itself (more means the compiler recomputed to fit)."""
    return work.policy_activations(c.remat, c.precision).flops_factor


def search(
    work: Workload,
    tx: Optimizer,
    candidates: Sequence[Candidate],
    profile: DeviceProfile | Cluster,
    *,
    memory_budget: int | None = None,
    remats: Sequence[str] = ("none",),
    accumulates: bool = False,
    **kw: Any,
) -> list[Scored]:
    """Score every candidate whose data-parallel size divides the batch and whose tensor axis, if any, is used
    and divides what it splits (as Megatron needs the heads divisible by the tensor-parallel size). A candidate
    predicted over ``memory_budget``, or fitting only by the compiler's rematerialization (`Stack.compiler_remat`),
    is also scored with each remat policy of ``remats`` and microbatch count (`policy_variants`): they only save
    memory (each costs recomputation or a loop trip), so a plan that fits without them is never slower with them.
    A pipelined candidate is also scored with each of its microbatch counts, fitting or not: more microbatches
    shrink the bubble (1F1B holds at most S of them in flight)."""
    found: list[tuple[int, int, Scored]] = []
    sharded: dict[Any, Any] = {}
    kw.setdefault("cache", {})
    position = {id(c): i for i, c in enumerate(candidates)}
    for c in sorted(candidates, key=lambda c: -c.zero_stage):  # stage 3 first: its specs serve 1 and 2
        dp = replicas(c.mesh_shape)
        if work.global_batch % dp or work.policy_activations(c.remat, c.precision) is None:
            continue
        group = (tuple(c.mesh_shape.items()), c.zero_axes)
        s = score(work, tx, c, profile, sharded_specs=sharded.get(group), **kw)
        if c.zero_stage == 3:
            sharded[group] = s.plan.param_specs
        if c.mesh_shape["tensor"] > 1 and (not _uses_tensor(s) or s.estimate.tensor_cuts):
            continue
        found.append((position[id(c)], 0, s))
        if (
            memory_budget is not None
            and s.estimate.bytes > memory_budget
            or s.estimate.flops_factor > _own_factor(work, c)
        ):
            variants = policy_variants(c, work, remats, accumulates)
        elif c.mesh_shape["stage"] > 1:  # more microbatches shrink a pipeline's bubble: a speed choice too
            variants = policy_variants(c, work, (c.remat,), accumulates)
        else:
            variants = []
        settled: set[str] = set()  # unpipelined: remat policies whose fewest fitting microbatches are scored
        for i, v in enumerate(variants):  # ascending microbatch counts
            if v.remat in settled:  # more microbatches of a plan that fits only add loop trips and smaller matmuls
                continue
            sv = score(work, tx, v, profile, sharded_specs=sharded.get(group), **kw)
            found.append((position[id(c)], i + 1, sv))
            fits = memory_budget is None or sv.estimate.bytes <= memory_budget
            if c.mesh_shape["stage"] == 1 and fits and sv.estimate.flops_factor <= _own_factor(work, v):
                settled.add(v.remat)
    out = [s for _, _, s in sorted(found, key=lambda t: t[:2])]
    if not out:
        raise PlanningError(
            f"no candidate mesh divides the global batch {work.global_batch} over its data-parallel axes; "
            "use a batch that is a multiple of the device count"
        )
    return out


def _key(s: Scored, best: float) -> tuple:
    c = s.candidate
    if s.estimate.seconds > best * (1 + TIE):
        return (1, False, 0.0, 0, 0, 0, 0, 0, s.estimate.seconds)
    remat = REMAT_POLICIES.index(c.remat)  # the less recomputation first (the compiler's too), host offload last
    recompute = round(s.estimate.flops_factor, 6)
    return (
        0,
        c.remat == "offload",
        recompute,
        remat,
        c.microbatches,
        c.zero_stage,
        c.mesh_shape["tensor"],
        s.estimate.bytes,
        s.estimate.seconds,
    )


def rank(scored: Sequence[Scored], memory_budget: int | None) -> list[Scored]:
    """Fitting candidates best first; raise `MemoryBudgetError` (with the smallest need) when none fits."""
    fits = [s for s in scored if memory_budget is None or s.estimate.bytes <= memory_budget]
    if not fits:
        smallest = min(scored, key=lambda s: s.estimate.bytes)
        raise MemoryBudgetError(
            f"no sharding fits the memory budget of {format_bytes(memory_budget)} per device; the smallest "
            f"achievable is {format_bytes(smallest.estimate.bytes)} ({smallest.estimate.bytes} bytes) with "
            f"{smallest.candidate.label}. Raise the budget, use more devices, or shrink the batch/microbatch"
        )
    best = min(s.estimate.seconds for s in fits)
    return sorted(fits, key=lambda s: _key(s, best))


def why(ranked: Sequence[Scored], scored: Sequence[Scored], memory_budget: int | None) -> tuple[str, ...]:
    """One-line reasons the first of ``ranked`` won."""
    win = ranked[0]
    over = len(scored) - len(ranked)
    notes = [
        f"{win.candidate.label}: predicted {win.estimate.seconds * 1e3:.2f} ms/step, "
        f"{format_bytes(win.estimate.bytes)}/device, {format_bytes(win.estimate.comm_bytes)} sent/step",
        f"{len(scored)} candidates scored; {over} exceed the budget {format_bytes(memory_budget)}"
        if memory_budget is not None
        else f"{len(scored)} candidates scored; no memory budget",
    ]
    if len(ranked) > 1:
        nxt = ranked[1]
        ratio = nxt.estimate.seconds / max(win.estimate.seconds, 1e-12)
        notes.append(
            f"runner-up {nxt.candidate.label}: {ratio:.2f}x the predicted time"
            + (
                " (a tie: less recomputation, fewer microbatches, lower ZeRO stage, smaller tensor axis, less memory "
                "preferred)"
                if ratio <= 1 + TIE
                else ""
            )
        )
    c = win.candidate
    if c.remat != "none" or c.microbatches > 1:
        plain = next(
            (s for s in scored if s.candidate == dataclasses.replace(c, remat="none", microbatches=1)),
            None,
        )
        if plain is not None:
            notes.append(
                f"remat={c.remat}, {c.microbatches} microbatch(es): without them {plain.candidate.label} needs "
                f"{format_bytes(plain.estimate.bytes)} > the budget {format_bytes(memory_budget)}; this is the "
                "fastest predicted way to fit"
            )
    return tuple(notes)


def remat_options(remat: str | Sequence[str], devices: Sequence[jax.Device]) -> tuple[str, ...]:
    """The remat policies to search: ``"auto"`` is every one ``devices`` can run; a name or a list is taken as
    given (``"offload"`` where there is no host memory space is a `PlanningError`)."""
    if remat == "auto":
        return available_remat(devices)
    names = (remat,) if isinstance(remat, str) else tuple(remat)
    for name in names:
        if check_remat(name) not in available_remat(devices):
            raise PlanningError(
                f"remat policy {name!r} is not available on {devices[0].platform} devices: they have no pinned host "
                "memory space to offload to; use 'dots' or 'full'"
            )
    return names


def precision_options(precision: str | Sequence[str]) -> tuple[str, ...]:
    """The precision policies to search: ``"auto"`` is fp32, bf16 and bf16_params (fp16 only when named: it needs
    a loss-scaling step); a name or a list is taken as given."""
    names = (
        ("fp32", "bf16", "bf16_params")
        if precision == "auto"
        else (precision,)
        if isinstance(precision, str)
        else tuple(precision)
    )
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown:
        raise PlanningError(f"unknown precision {unknown}; expected 'auto' or names from {tuple(PRECISIONS)}")
    return names


VERIFY_TRIES = 8
"""Candidates compiled at most, in ranked order, when the compiled bytes of the first exceed the budget."""


def memory_budget_for(
    devices: Sequence[jax.Device], profile: DeviceProfile, given: int | None
) -> tuple[int | None, str]:
    """(per-device budget, where it came from): ``given``, else what the runtime lets a device allocate
    (``bytes_limit``), else the profile's memory size (a spec sheet), else none (CPU)."""
    if given is not None:
        return given, "given"
    limit = device_memory_limit(devices)
    if limit is not None:
        return limit, "the devices' bytes_limit"
    if profile.memory_bytes is not None:
        return profile.memory_bytes, f"the {profile.name} spec sheet"
    return None, "none: the devices report no memory limit"


def variants_of(
    work: Workload,
    tx: Optimizer,
    profile: DeviceProfile | Cluster,
    remats: Sequence[str],
    accumulates: bool,
    **kw: Any,
) -> Callable[[Scored], list[Scored]]:
    """The ``expand`` of `first_that_compiles_within`: a candidate's remat and microbatch variants
    (`policy_variants`), scored."""

    def expand(s: Scored) -> list[Scored]:
        return [score(work, tx, v, profile, **kw) for v in policy_variants(s.candidate, work, remats, accumulates)]

    return expand


def first_that_compiles_within(
    ranked: Sequence[Scored],
    compiled_bytes: Callable[[ShardingPlan], int | None],
    budget: int | None,
    expand: Callable[[Scored], Sequence[Scored]] | None = None,
) -> tuple[Scored, int | None, list[str]]:
    """(the first of ``ranked`` whose AOT-compiled bytes fit ``budget``, its compiled bytes, notes), compiling at
    most `VERIFY_TRIES`. A pipelined candidate is taken on its prediction here: its step is the pipeline's, which
    `openhosti_jax.create_train_state` builds and compiles from the model.

    A candidate that compiles over the budget teaches what the prediction missed for its family (same mesh, ZeRO
    stage, precision): ``expand`` scores its policy variants (remat, microbatches), and every candidate of the
    family is then judged on its prediction plus that measured excess; those still predicted to fit join the
    queue in rank order, the others are skipped without a compile.

    Raises `MemoryBudgetError` naming the smallest compiled size when every one tried compiles over the budget:
    a plan is never returned that the compiler says does not fit.
    """
    notes: list[str] = []
    over: list[tuple[int, Scored]] = []
    excess: dict[tuple, int] = {}
    best = min((s.estimate.seconds for s in ranked), default=0.0)
    queue = list(ranked)
    seen = {(s.candidate.label, s.candidate.zero_axes) for s in ranked}
    while queue and len(over) < VERIFY_TRIES:
        s = queue.pop(0)
        family = _family(s.candidate)
        if budget is not None and family in excess and s.estimate.bytes + excess[family] > budget:
            continue  # its family compiled over the prediction by more than this one's headroom
        if s.plan.pipeline_stages > 1:
            notes.append(
                f"{s.candidate.label}: pipelined over {s.plan.pipeline_stages} stages, 1F1B with "
                f"{s.plan.num_microbatches} microbatches; taken on its prediction (the pipeline step is compiled "
                "when create_train_state builds it)"
            )
            return s, None, notes
        compiled = compiled_bytes(s.plan)
        if compiled is None or budget is None or compiled <= budget:
            if over:
                notes.insert(
                    0,
                    f"{s.candidate.label}: the {len(over)} compiled before it by rank exceeded the budget "
                    f"{format_bytes(budget)}",
                )
            return s, compiled, notes
        over.append((compiled, s))
        excess[family] = max(excess.get(family, 0), compiled - s.estimate.bytes)
        notes.append(f"{s.candidate.label} compiled to {format_bytes(compiled)} > budget; trying next")
        for v in sorted(expand(s) if expand is not None else (), key=lambda x: _key(x, best)):
            if (v.candidate.label, v.candidate.zero_axes) not in seen:  # before the first that ranks after it
                seen.add((v.candidate.label, v.candidate.zero_axes))
                at = next((i for i, q in enumerate(queue) if _key(q, best) > _key(v, best)), len(queue))
                queue.insert(at, v)
    smallest, top = min(over, key=lambda t: t[0])
    raise MemoryBudgetError(
        f"no sharding compiles within the memory budget of {format_bytes(budget)} ({budget} bytes) per device: the "
        f"{len(over)} compiled in rank order came to "
        + ", ".join(f"{s.candidate.label} {format_bytes(c)}" for c, s in over)
        + f"; the smallest is {smallest} bytes with {top.candidate.label}. Raise the budget, use more devices, or "
        "shrink the batch/microbatch"
    )


def report_for(
    winner: Scored, ranked: Sequence[Scored], notes: Sequence[str], work: Workload, compiled_bytes: int | None = None
) -> PlanReport:
    """The `PlanReport` of ``winner``: its predictions, the ranking as data, the reasons."""
    e = winner.estimate
    return PlanReport(
        winner.plan,
        work.params,
        predicted_bytes=e.bytes,
        predicted_seconds=e.seconds,
        predicted_comm_bytes=int(e.comm_bytes),
        predicted_parts={"time": dict(e.time), "memory": dict(e.memory)},
        compiled_bytes=compiled_bytes,
        candidates=tuple(s.row() for s in ranked),
        notes=tuple(notes),
    )


def plan_on_mesh(
    abstract_params: Any,
    tx: Optimizer,
    mesh: Mesh,
    *,
    memory_budget: int | None = None,
    sample_batch: Any | None = None,
    step_fn: Any | None = None,
    apply_fn: ApplyFn | None = None,
    model_state: Any = None,
    device_profile_: DeviceProfile | str | None = None,
    rules: Rules = DEFAULT_RULES,
    verify: bool = True,
    state: Any = None,
    layout: Any = None,
    remat: str | Sequence[str] = "auto",
    precision: str | Sequence[str] = "fp32",
) -> tuple[ShardingPlan, PlanReport]:
    """(plan, report) for the best ZeRO stage (and tensor-parallel specs when ``tensor`` > 1) on ``mesh``, with
    the remat policy (``"auto"``: any the devices run, used when the plan would not fit otherwise), the precision
    (``"fp32"`` unless the user allows others: they change results) and the microbatch count the step can take.

    Use it instead of `openhosti_jax.choose_plan` (the planner's first entry point, which also chooses the mesh)
    when the mesh is already built and its axis sizes are not to change; ``create_train_state(..., plan="auto")``
    and ``@spmd`` call it on their mesh.

    Activations and FLOPs come from ``apply_fn`` on ``sample_batch``, or, with no apply function, from the user's
    ``step_fn`` traced on its abstract ``state`` (whose parameters and optimizer state ``layout`` locates); with
    neither, the choice rests on state memory and gradient traffic. With ``step_fn`` and ``sample_batch`` the
    winner is AOT-compiled to record its bytes.
    """
    sizes = {a: mesh_sizes(mesh).get(a, 1) for a in AXES}
    dp = replicas(sizes)
    batch = sample_batch if sample_batch is not None else jax.ShapeDtypeStruct((dp,), "float32")
    if apply_fn is None and step_fn is not None and state is not None and sample_batch is not None:
        work = measure_step(step_fn, state, batch, abstract_params, layout)
    else:
        work = measure(abstract_params, model_state, apply_fn if sample_batch is not None else None, batch)
    devices = list(mesh.devices.flat)
    profile = device_profile(devices, device_profile_, max_bytes=gradient_bytes(work))
    budget, source = memory_budget_for(devices, profile, memory_budget)
    stages = [0] if dp == 1 else [0, 1, 2, 3]
    sequence = sizes.get("tensor", 1) > 1 and sizes.get("stage", 1) == 1 and profile.native_reduce_scatter
    candidates = [
        Candidate(sizes, z, precision=p, sequence_parallel=sequence)
        for p in precision_options(precision)
        for z in stages
    ]
    accumulates = step_fn is not None and sample_batch is not None and step_accumulates(work, tx, step_fn)
    remats = remat_options(remat, devices)
    scored = search(
        work,
        tx,
        candidates,
        profile,
        rules=rules,
        memory_budget=budget,
        remats=remats,
        accumulates=accumulates,
    )
    ranked = rank(scored, budget)
    notes = [*why(ranked, scored, budget), f"memory budget: {source}"]
    winner, compiled = ranked[0], None
    if verify and step_fn is not None and sample_batch is not None:
        winner, compiled, verified = first_that_compiles_within(
            ranked,
            lambda p: compiled_step_bytes(p, work, tx, step_fn, mesh),
            budget,
            variants_of(work, tx, profile, remats, accumulates, rules=rules),
        )
        notes += verified
    return winner.plan, report_for(winner, ranked, notes, work, compiled)
