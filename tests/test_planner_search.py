"""Planner search: budget-driven ZeRO choice, typed error when nothing fits, AOT-verified plan, report."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from openhosti_jax.errors import MemoryBudgetError
from openhosti_jax.planner import PROFILES, choose_plan
from openhosti_jax.planner.search import TIE, enumerate_candidates, rank, search
from openhosti_jax.planner.workload import workload


class MLP(nnx.Module):
    def __init__(self, rngs):
        # names the tensor-parallel patterns do not know: the search is over data/fsdp x ZeRO stage only
        self.l1 = nnx.Linear(512, 2048, rngs=rngs)
        self.l2 = nnx.Linear(2048, 512, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


BATCH = jax.ShapeDtypeStruct((8, 512), jnp.float32)
P_ELEMS = 512 * 2048 * 2 + 2048 + 512


def scored():
    w = workload(lambda r: MLP(nnx.Rngs(r)), BATCH)
    return search(w, optax.adam(1e-3), enumerate_candidates(8), PROFILES["H100"])


def test_enumeration_covers_every_factorisation():
    cands = enumerate_candidates(8)
    shapes = {(c.mesh_shape["data"], c.mesh_shape["fsdp"], c.mesh_shape["tensor"]) for c in cands}
    brute = {(d, f, t) for d in range(1, 9) for f in range(1, 9) for t in range(1, 9) if d * f * t == 8}
    assert shapes == brute
    assert len(cands) == len({(c.label) for c in cands})


def test_predicted_state_matches_formula():
    """params + Adam state (fp32) per device: 12P, 4P + 8P/N, 12P/N bytes (gradients are temporaries)."""
    by_label = {s.candidate.label: s for s in scored()}
    p = P_ELEMS
    for label, expected in [
        ("data=8 zero0", 12 * p),
        ("fsdp=8 zero1", 4 * p + 8 * p / 8),
        ("fsdp=8 zero3", 12 * p / 8),
    ]:
        got = by_label[label].estimate.memory["state"]
        assert abs(got / expected - 1) < 0.01, (label, got, expected)


def test_budget_excluding_zero01_picks_2_or_3_and_loose_budget_picks_lower():
    s = scored()
    low = min(x.estimate.bytes for x in s if x.candidate.zero_stage <= 1)
    high = min(x.estimate.bytes for x in s if x.candidate.zero_stage >= 2)
    assert high < low
    budget = (low + high) // 2
    tight, tight_report = choose_plan(
        lambda r: MLP(nnx.Rngs(r)), optax.adam(1e-3), BATCH, memory_budget=budget, verify=False, device_profile="H100"
    )
    assert tight.zero_stage in (2, 3) and tight_report.predicted_bytes <= budget
    loose, loose_report = choose_plan(
        lambda r: MLP(nnx.Rngs(r)), optax.adam(1e-3), BATCH, memory_budget=10 * low, verify=False, device_profile="H100"
    )
    assert loose.zero_stage < tight.zero_stage
    assert loose_report.predicted_seconds <= min(x.estimate.seconds for x in s) * 1.02 + 1e-12


def test_ties_go_to_lower_stage_then_less_memory_and_the_rest_by_time():
    """Inside the tie band: lowest ZeRO stage, then smallest predicted memory; outside it: predicted time only."""

    def with_cost(s, seconds, nbytes):
        est = s.estimate
        time = {**est.time, "total": seconds}
        memory = {**est.memory, "total": float(nbytes)}
        return dataclasses.replace(s, estimate=dataclasses.replace(est, time=time, memory=memory))

    by_label = {s.candidate.label: s for s in scored()}
    best = 1.0
    cands = [
        with_cost(by_label["data=4 fsdp=2 zero1"], best, 300),  # fastest predicted, most memory
        with_cost(by_label["data=2 fsdp=4 zero1"], best * (1 + TIE / 2), 200),
        with_cost(by_label["fsdp=8 zero1"], best * (1 + TIE), 100),  # least memory, at the band's edge
        with_cost(by_label["data=2 fsdp=4 zero2"], best * (1 + TIE / 4), 50),  # a higher stage: after stage 1
        with_cost(by_label["fsdp=8 zero3"], best * (1 + 3 * TIE), 10),  # outside the band
        with_cost(by_label["fsdp=8 zero2"], best * (1 + 2 * TIE), 20),
    ]
    order = [s.candidate.label for s in rank(cands, None)]
    assert order == [
        "fsdp=8 zero1",
        "data=2 fsdp=4 zero1",
        "data=4 fsdp=2 zero1",
        "data=2 fsdp=4 zero2",
        "fsdp=8 zero2",
        "fsdp=8 zero3",
    ]
    with_dp = [with_cost(by_label["data=8 zero0"], best * (1 + TIE / 2), 1000), *cands]
    assert rank(with_dp, None)[0].candidate.label == "data=8 zero0"  # the lowest stage in the band wins
    assert rank(with_dp, 150)[0].candidate.label == "fsdp=8 zero1"  # unless the budget excludes it


def test_nothing_fits_raises_with_smallest_achievable():
    """Below the smallest of everything the planner scores (meshes, ZeRO stages, remat policies, microbatches):
    a typed error that names it."""

    def plan(budget):
        return choose_plan(
            lambda r: MLP(nnx.Rngs(r)),
            optax.adam(1e-3),
            BATCH,
            memory_budget=budget,
            verify=False,
            device_profile="H100",
        )

    with pytest.raises(MemoryBudgetError, match=r"the smallest achievable is .* \((\d+) bytes\)") as err:
        plan(1)
    smallest = int(re.search(r"\((\d+) bytes\)", str(err.value)).group(1))
    assert smallest <= min(x.estimate.bytes for x in scored())  # remat and microbatches may go below the plain search
    assert plan(smallest)[0] is not None
    with pytest.raises(MemoryBudgetError, match=str(smallest)):
        plan(smallest - 1)


@pytest.mark.timeout(300)
def test_verified_plan_records_compiled_bytes_and_prints():
    p, report = choose_plan(lambda r: MLP(nnx.Rngs(r)), optax.adam(1e-3), BATCH, device_profile="H100")
    assert report.plan is p
    assert report.compiled_bytes and 0.7 < report.predicted_bytes / report.compiled_bytes < 1.4
    text = str(report)
    assert "compiled" in text and "why:" in text and "candidates" in text and "largest unsharded" in text
    assert [c.label for c in report.candidates[:1]] == [report.notes[0].split(":")[0]]  # the ranking is data
    assert "why:" not in str(p) and "ZeRO stage" in str(p)  # the plan prints the decision only
    assert sum(p.mesh_shape.values()) >= 1 and p.mesh_shape["data"] * p.mesh_shape["fsdp"] * p.mesh_shape["tensor"] == 8


def test_a_context_axis_is_offered_where_sequences_are_few_and_priced_by_its_key_value_exchange():
    """Context sizes are offered when the batch has no more sequences than devices and the model names its keys and
    values; a context=4 plan costs what data=4 does (the same examples' worth of tokens per device, the same
    gradient all-reduce) plus the key/value exchange: per layer every device gathers the sequence's keys and values
    twice (forward, backward) and reduce-scatters their gradients, 3 x (n-1)/n of the gathered bytes on the bus."""
    from openhosti_jax.models.presets import model_preset
    from openhosti_jax.planner.cost import kv_width
    from openhosti_jax.planner.search import Candidate, context_sizes, score

    p = model_preset("llama3-8b", n_layers=2, seq_len=1024)
    few, many = workload(p.init, p.sample_batch(8)), workload(p.init, p.sample_batch(128))
    assert context_sizes(few, 64, 8) == (1, 2, 4, 8) and context_sizes(many, 64, 8) == (1,)
    assert kv_width(few) == (2 * 8 * 128, 2)  # k and v: 8 heads of 128, two layers
    shapes = {tuple(c.mesh_shape.values()) for c in enumerate_candidates(64, context=(1, 4), pipeline=True)}
    assert (1, 16, 1, 4, 1) in shapes and (1, 1, 4, 4, 4) in shapes
    no_pipe = enumerate_candidates(64, context=(1, 4), pipeline=True, pipeline_context=False)
    assert not any(c.mesh_shape["stage"] > 1 and c.mesh_shape["context"] > 1 for c in no_pipe)

    def bus(mesh):
        sizes = {"stage": 1, "data": 1, "fsdp": 1, "context": 1, "tensor": 1} | mesh
        return score(few, optax.adam(1e-3), Candidate(sizes, 0), PROFILES["H100"]).estimate.comm_bytes

    width, layers = kv_width(few)
    gathered = layers * 8 * 1024 * width * few.activation_itemsize  # the whole batch's keys and values
    assert bus({"context": 4}) - bus({"data": 4}) == pytest.approx(3 * gathered * 3 / 4, rel=1e-9)
