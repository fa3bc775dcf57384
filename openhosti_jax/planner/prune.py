"""`pruned_search`: `search`'s winner without scoring the candidates that provably cannot fit or win.

`search` scores every candidate and, for those over the budget, every remat policy and microbatch count
(`policy_variants`): about 14,000 estimates for Llama-3 405B on 1,024 H100, of which ~1,200 fit. Most of them
cannot win. Within a family (a mesh shape, ZeRO stage and axes, precision: what `score` makes specs for once) its
variants differ only in the remat policy and the microbatch count, and these floors hold for each of them:

- **state**: the parameters and optimizer state as sharded and the local batch are the family's whatever the
  policy (only the step's temporaries change, and they are never negative): a family whose plain candidate's
  state and batch exceed the budget has no variant that fits (`state_floor`).
- **matmuls**: a step takes at least a pipeline stage's work, whose matmul seconds are the FLOPs factor times those
  at factor 1, which depend on the mesh shape and precision only (the same examples per device and tensor split,
  whatever the ZeRO stage) and never fall with more microbatches (a smaller microbatch runs smaller matmuls;
  `DeviceProfile.matmul_curve` is non-decreasing in size). The least FLOPs factor of a remat policy is its own or
  remat ``"full"``'s, where a compiler rematerializes to fit (`factor_floor`). So one pricing of the matmuls per
  mesh shape and precision (`cost.matmul_seconds`), times the pipeline's bubble at the most microbatches a variant
  runs, bounds every candidate of it (`mesh_floor`).
- **memory traffic**: once a family's plain candidate is scored, its variants' floor adds the bytes it streams (of
  which the activations' and elementwise ops' scale with the FLOPs factor, the update's not), at the fastest
  bandwidth of the profile's memory curve, the bubble at each variant's own microbatch count, and at the plain's
  microbatch count the collectives it waits for (`variant_floor`); the plain of a mesh's first ZeRO stage bounds
  the others of the same ZeRO axes the same way (their update streams as many bytes: stage 0 more).

`rank`'s winner is the fitting candidate first by its key, and a candidate more than `TIE` slower than the fastest
that fits ranks after every one within it. So a candidate whose floor exceeds the fastest fitting time found so far
by more than `TIE` cannot win and is not scored. The mesh shapes are visited by floor, fastest first, and the visit
stops at the first whose floor is past that mark. What is scored is scored as `search` scores it (the same `score`,
specs and estimates), in the same order of `rank`'s ties, so the winner is `search`'s, priced the same. Where
nothing scored fits, `search` runs in full (its error names the smallest need of all).

Example:
    >>> import optax
    >>> from openhosti_jax.models.presets import model_preset
    >>> from openhosti_jax.planner.cluster import cluster
    >>> from openhosti_jax.planner.search import enumerate_candidates, rank, search
    >>> from openhosti_jax.planner.workload import workload
    >>> p = model_preset("llama3-70b", n_layers=2)
    >>> work, tx, where = workload(p.init, p.sample_batch(64)), optax.adamw(1e-4), cluster("64xH100")
    >>> cands, kw = enumerate_candidates(64, max_tensor=8, precisions=("bf16",)), {"remats": ("none", "full")}
    >>> full = search(work, tx, cands, where, memory_budget=2**34, accumulates=True, **kw)
    >>> pruned = pruned_search(work, tx, cands, where, memory_budget=2**34, accumulates=True, **kw)
    >>> rank(pruned, 2**34)[0].candidate == rank(full, 2**34)[0].candidate, len(pruned) < len(full) / 1.5
    (True, True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from openhosti_jax.planner.cluster import Cluster
from openhosti_jax.planner.cost import bubble_factor, matmul_seconds
from openhosti_jax.planner.profiles import DeviceProfile
from openhosti_jax.planner.search import (
    TIE,
    Candidate,
    Scored,
    _own_factor,
    _uses_tensor,
    plan_for,
    replicas,
    score,
    search,
    variant_policies,
)
from openhosti_jax.planner.workload import Workload
from openhosti_jax.sharding.zero import Optimizer

ROUNDING = 1e-9
"""The relative margin a floor keeps below what it bounds, for floating-point rounding."""


def mesh_key(c: Candidate) -> tuple:
    """What fixes a candidate's compute time at FLOPs factor 1 and its first microbatch count: the mesh shape, the
    precision (a stack's attention kernel runs in some only), the sequence split and the interleaving."""
    return (tuple(c.mesh_shape.items()), c.precision, c.sequence_parallel, c.virtual)


def factor_floor(work: Workload, remat: str, precision: str) -> float:
    """The least FLOPs factor a candidate with ``remat`` and ``precision`` is priced at: the policy's own, or remat
    ``"full"``'s where that is less (a compiler that rematerializes to fit adds recomputation up to it)."""
    own = work.policy_activations(remat, precision).flops_factor
    full = work.policy_activations("full", precision)
    return min(own, full.flops_factor) if full is not None else own


def compute_floor(work: Workload, tx: Optimizer, c: Candidate, profile: DeviceProfile | Cluster, **kw: Any) -> float:
    """``c``'s matmul seconds per step at FLOPs factor 1 and its first microbatch count
    (`openhosti_jax.planner.cost.matmul_seconds`), less `ROUNDING`: those of every candidate of its `mesh_key` (any
    ZeRO stage) at factor 1, and no more than theirs at more microbatches (``kw``: `score`'s)."""
    _, plan, base, sharded, tx = plan_for(work, tx, c, profile, state=False, **kw)
    return matmul_seconds(plan, work, tx, profile, base, sharded) * (1 - ROUNDING)


def mesh_floor(
    work: Workload, tx: Optimizer, c: Candidate, profile: DeviceProfile | Cluster, remats: Sequence[str], **kw: Any
) -> tuple[float, float, int]:
    """(a floor on the step time of every candidate of ``c``'s `mesh_key` with a remat policy of ``remats``, any
    ZeRO stage and microbatch count; the least FLOPs factor of ``remats``; the most microbatches a policy variant
    of it runs): `compute_floor` times the least `factor_floor` and the pipeline's bubble at the most
    microbatches."""
    least = min(factor_floor(work, r, c.precision) for r in remats)
    most = work.global_batch // replicas(c.mesh_shape)
    bubble = bubble_factor(c.mesh_shape["stage"], most, c.virtual)
    return compute_floor(work, tx, c, profile, **kw) * least * bubble, least, most


def variant_floor(
    plain: Scored, factor: float, microbatches: int, profile: DeviceProfile | Cluster, family: bool = True
) -> float:
    """A floor on the step time of the candidates of ``plain``'s family (``plain``: its candidate without remat, at
    its fewest microbatches) with ``microbatches`` and a FLOPs factor of at least ``factor``: a pipeline stage's
    work, its matmul seconds (``plain``'s at factor 1, times ``factor``) and the seconds of the bytes it streams
    through device memory (``plain``'s, of which the activations' and the elementwise ops' scale with the factor
    and the update's do not, at the fastest bandwidth of `DeviceProfile.memory_curve`: a smaller working set may
    stream faster), times the pipeline's bubble (`bubble_factor`), and at ``plain``'s microbatch count the
    collectives it waits for (more recomputation adds to a mixture of experts' all-to-alls, never less); less
    `ROUNDING`. Neither the matmuls nor the bytes take less with more microbatches (the same bytes; smaller
    matmuls). ``family=False``: of the other ZeRO stages of ``plain``'s mesh shape, precision and ZeRO axes too
    (their update streams as many bytes or more: stage 0 unsharded), without the waits (a gradient reduction's
    depends on the stage)."""
    e, c = plain.estimate, plain.candidate
    device = profile.profile if isinstance(profile, Cluster) else profile
    work = e.time["compute"] / e.flops_factor * factor
    if c.remat == "none":  # (a recomputing plain streams its recomputed scores too: matmuls alone)
        fastest = device.memory_seconds(1.0, 1.0) / device.memory_seconds(1.0, e.memory["total"])
        work += e.time["memory"] * fastest * min(1.0, factor / e.flops_factor)
    same = family and c.remat == "none" and microbatches == plain.plan.num_microbatches
    waits = e.time["exposed"] if same else 0.0
    return (work * bubble_factor(c.mesh_shape["stage"], microbatches, c.virtual) + waits) * (1 - ROUNDING)


def state_floor(s: Scored) -> float:
    """``s``'s bytes per device besides the step's temporaries (state and batch): those of every remat policy and
    microbatch count of its family."""
    return s.estimate.memory["state"] + s.estimate.memory["batch"]


def pruned_search(
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
    """The candidates of `search` (same arguments) that can still fit and win, scored as it scores them: its
    winner under `rank`, with far fewer estimates (the bounds are in this module's docstring)."""
    kw.setdefault("cache", {})
    position = {id(c): i for i, c in enumerate(candidates)}
    groups: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        if work.global_batch % replicas(c.mesh_shape) == 0 and work.policy_activations(c.remat, c.precision):
            groups.setdefault(mesh_key(c), []).append(c)
    floors = []
    for members in groups.values():
        members.sort(key=lambda c: -c.zero_stage)  # stage 3 first, as `search` scores them
        precision = members[0].precision
        names = {c.remat for c in members} | {r for r in remats if work.policy_activations(r, precision)}
        floors.append((*mesh_floor(work, tx, members[0], profile, sorted(names), **kw), members))
    found: list[tuple[int, int, Scored]] = []
    best = [math.inf]  # the fastest fitting time scored so far

    def add(c: Candidate, i: int, s: Scored) -> bool:
        found.append((position[id(c)], i, s))
        fits = memory_budget is None or s.estimate.bytes <= memory_budget
        best[0] = min(best[0], s.estimate.seconds) if fits else best[0]
        return fits

    for floor, least, most, members in sorted(floors, key=lambda t: t[0]):
        if floor > best[0] * (1 + TIE):
            break  # this mesh shape and every later one cannot come within the tie band of the fastest
        first: Scored | None = None  # the mesh's first scored: its bytes streamed bound the other stages'
        for c in members:
            mine = floor
            if first is not None and c.zero_axes == first.candidate.zero_axes:
                mine = max(floor, variant_floor(first, least, most, profile, family=False))
            if mine > best[0] * (1 + TIE):
                continue
            s = score(work, tx, c, profile, **kw)
            if _unusable(s):
                continue
            first = first or s
            add(c, 0, s)
            settled: set[str] = set()  # as in `search`: the fewest fitting microbatches of each remat policy
            for i, (remat, k) in enumerate(_variants(s, work, memory_budget, remats, accumulates)):
                if remat in settled:
                    continue
                runs = s.plan.num_microbatches if k == 1 else k  # (a pipeline's default where k is 1)
                if variant_floor(s, factor_floor(work, remat, c.precision), runs, profile) > best[0] * (1 + TIE):
                    continue
                v = dataclasses.replace(c, remat=remat, microbatches=k)
                fits = add(c, i + 1, score(work, tx, v, profile, **kw))
                if c.mesh_shape["stage"] == 1 and fits and found[-1][2].estimate.flops_factor <= _own_factor(work, v):
                    settled.add(remat)
    if math.isinf(best[0]):  # nothing scored fits: the full search, whose error names the smallest need of all
        return search(
            work, tx, candidates, profile, memory_budget=memory_budget, remats=remats, accumulates=accumulates, **kw
        )
    return [s for _, _, s in sorted(found, key=lambda t: t[:2])]


def _variants(
    s: Scored, work: Workload, budget: int | None, remats: Sequence[str], accumulates: bool
) -> list[tuple[str, int]]:
    """The (remat policy, microbatch count) of each policy variant `search` scores after the plain ``s``, in its
    order (`variant_policies`), none where no variant can fit."""
    c = s.candidate
    if budget is not None and state_floor(s) > budget:
        return []  # no remat policy or microbatch count brings the state within the budget
    if budget is not None and s.estimate.bytes > budget or s.estimate.flops_factor > _own_factor(work, c):
        return variant_policies(c, work, remats, accumulates)
    if c.mesh_shape["stage"] > 1:  # more microbatches shrink a pipeline's bubble: a speed choice too
        return variant_policies(c, work, (c.remat,), accumulates)
    return []


def _unusable(s: Scored) -> bool:
    """Whether ``s`` splits over a tensor axis that no leaf uses, or that cuts a reshape unevenly (`search` drops
    these)."""
    return s.candidate.mesh_shape["tensor"] > 1 and (not _uses_tensor(s) or bool(s.estimate.tensor_cuts))
