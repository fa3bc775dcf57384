"""The pruned search (`openhosti_jax.planner.prune`) against the exhaustive one on small models over several clusters
and software stacks: the same winner, priced the same, from fewer estimates; every floor it prunes by is below what
the exhaustive search prices for each candidate it bounds; nothing fitting gives the same error."""

import dataclasses
import functools

import jax.numpy as jnp
import optax
import pytest
from jax import ShapeDtypeStruct

import openhosti_jax.planner.choose as choose
from openhosti_jax.errors import MemoryBudgetError
from openhosti_jax.models.presets import model_preset
from openhosti_jax.planner.cluster import cluster
from openhosti_jax.planner.cost import bubble_factor
from openhosti_jax.planner.prune import factor_floor, mesh_floor, mesh_key, state_floor, variant_floor
from openhosti_jax.planner.search import _family, replicas
from openhosti_jax.planner.stacks import STACKS

GiB = 2**30
CASES = {  # preset, its overrides, sequences per step, cluster, stack, memory budget (None: the device's)
    "llama-70b-64xH100-tight": ("llama3-70b", {"n_layers": 2}, 64, "64xH100", "openhosti", 16 * GiB),
    "llama-8b-v5p-64": ("llama3-8b", {"n_layers": 4, "seq_len": 2048}, 64, "v5p-64", "openhosti", 4 * GiB),
    "mixtral-16xH100-megatron": (
        "mixtral-8x7b",
        {"n_layers": 2, "seq_len": 512},
        32,
        "16xH100",
        "megatron-core",
        12 * GiB,
    ),
    "gpt-16xH100-torchtitan": (
        "gpt3-175b",
        {"n_layers": 2, "seq_len": 1024},
        32,
        "16xH100",
        "torchtitan-compile",
        10 * GiB,
    ),
    "llama-8b-long-2x8xH100": ("llama3-8b", {"n_layers": 2, "seq_len": 8192}, 8, "2x8xH100", "maxtext-gpu", 6 * GiB),
}

SEARCHES = {"search": choose.search, "pruned_search": choose.pruned_search}


@functools.cache
def plan(case, exhaustive, budget=None):
    """(plan, report, what the search saw and returned) for ``case``, as `openhosti_jax.predict` plans it (once per
    case: the tests read it)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _plan(case, exhaustive, budget, monkeypatch)


def _plan(case, exhaustive, budget, monkeypatch):
    name, overrides, batch, where, stack, given = CASES[case]
    preset = model_preset(name, **overrides)
    seen = {}
    for fn, inner in SEARCHES.items():

        def spy(*args, _inner=inner, _fn=fn, **kw):
            seen.update(fn=_fn, args=args, kw=kw, out=_inner(*args, **kw))
            return seen["out"]

        monkeypatch.setattr(choose, fn, spy)
    c = dataclasses.replace(cluster(where), stack=STACKS[stack])
    p, report = choose.choose_plan(
        preset.init,
        optax.adamw(1e-4),
        ShapeDtypeStruct((batch, preset.config.seq_len), jnp.int32),
        cluster=c,
        pipeline=True,
        remat="auto",
        precision="auto",
        accumulate=True,
        memory_budget=budget or given or c.profile.memory_bytes,
        exhaustive=exhaustive,
    )
    return p, report, seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pruned_search_chooses_the_exhaustive_winner_from_fewer_estimates(case):
    full_plan, full, every = plan(case, exhaustive=True)
    pruned_plan, pruned, some = plan(case, exhaustive=False)
    assert (every["fn"], some["fn"]) == ("search", "pruned_search")
    assert pruned.candidates[0] == full.candidates[0]  # label, predicted seconds, bytes and traffic
    assert pruned_plan.decision() == full_plan.decision() and pruned_plan.digest() == full_plan.digest()
    assert (pruned.predicted_seconds, pruned.predicted_bytes) == (full.predicted_seconds, full.predicted_bytes)
    assert len(some["out"]) < len(every["out"])
    assert any(n.startswith("pruned:") for n in pruned.notes) and not any(n.startswith("pruned:") for n in full.notes)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_floor_is_below_what_the_exhaustive_search_prices(case):
    """Each candidate the exhaustive search scores, against each floor that would bound it: its mesh shape's
    (`mesh_floor`, for its own remat policy), its family's plain candidate's (`variant_floor` and `state_floor`),
    and the plain candidates' of its mesh's other ZeRO stages with the same ZeRO axes (``family=False``)."""
    _, _, every = plan(case, exhaustive=True)
    work, tx, _, where = every["args"]
    out = every["out"]
    plains = {_family(s.candidate): s for s in out if (s.candidate.remat, s.candidate.microbatches) == ("none", 1)}
    assert len(plains) > 10 and len(out) > 2 * len(plains)  # the bounds meet policy variants, not only plains
    meshes = {}
    for s in out:
        c, e = s.candidate, s.estimate
        key = (mesh_key(c), c.remat)
        if key not in meshes:
            meshes[key] = mesh_floor(work, tx, plains[_family(c)].candidate, where, (c.remat,))
        floor, least, most = meshes[key]
        assert e.seconds >= floor, (c.label, e.seconds, floor)
        plain = plains[_family(c)]
        factor = factor_floor(work, c.remat, c.precision)
        assert e.seconds >= variant_floor(plain, factor, s.plan.num_microbatches, where), c.label
        assert e.bytes >= state_floor(plain), c.label
        for other in plains.values():
            if mesh_key(other.candidate) == mesh_key(c) and other.candidate.zero_axes == c.zero_axes:
                if other.candidate.zero_stage >= c.zero_stage:
                    assert e.seconds >= variant_floor(other, least, most, where, family=False), c.label
        stages, runs = c.mesh_shape["stage"], s.plan.num_microbatches  # no variant's bubble below the floor's
        assert bubble_factor(stages, runs, c.virtual) >= bubble_factor(stages, most, c.virtual) > 0, c.label
        assert most == work.global_batch // replicas(c.mesh_shape)


def test_nothing_fitting_raises_the_exhaustive_error():
    """Where no candidate fits, the pruned search runs the full one: the same error, naming the same smallest
    need."""
    errors = []
    for exhaustive in (True, False):
        with pytest.raises(MemoryBudgetError) as err:
            plan("gpt-16xH100-torchtitan", exhaustive, GiB // 2)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "the smallest achievable is" in errors[0]
