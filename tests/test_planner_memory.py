"""The memory model's two peaks (backward start, gradient reduction) against XLA's compiled buffer assignment."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from openhosti_jax.demo.examples import EXAMPLES, example_inputs, gpt_step
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.planner import PROFILES, choose_plan
from openhosti_jax.planner.profiles import XLA_CPU
from openhosti_jax.planner.search import enumerate_candidates, search
from openhosti_jax.planner.verify import compiled_step_bytes
from openhosti_jax.planner.workload import workload

# the CPU backend all-reduces a reduce-scattered gradient (then slices it): say so, as a calibrated profile does
CPU = dataclasses.replace(PROFILES["H100"], native_reduce_scatter=False, memory=XLA_CPU)


def scored(batch: int):
    init_fn, tx, _ = example_inputs("gpt-tiny")
    cfg, _ = EXAMPLES["gpt-tiny"]
    work = workload(init_fn, jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32))
    cands = enumerate_candidates(8, sequence_parallel=CPU.native_reduce_scatter)
    return work, tx, {s.candidate.label: s for s in search(work, tx, cands, CPU)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("label", "batch"),
    [
        ("data=8 zero0", 16),  # activations (the loss's included) + first gradient leaf
        ("data=8 zero0", 8),  # one example per device: the all-reduce's input and output gradients dominate
        ("fsdp=8 zero2", 16),  # on CPU reduce-scattered as all-reduce + slice: as ZeRO-0
        ("fsdp=8 zero3", 16),  # + the gathered full parameters during the backward
        ("data=2 fsdp=4 zero3", 8),
    ],
)
def test_predicted_bytes_match_compiled(label, batch):
    work, tx, by_label = scored(batch)
    s = by_label[label]
    mesh = build_mesh(MeshConfig.from_sizes(dict(s.plan.mesh_shape)))
    compiled = compiled_step_bytes(s.plan, work, tx, gpt_step, mesh)
    assert 0.9 < s.estimate.bytes / compiled < 1.1, (label, batch, s.estimate.memory, compiled)


def test_reduction_peak_is_twice_the_gradient_and_native_reduce_scatter_halves_it():
    work, tx, cpu = scored(8)
    grads = cpu["data=8 zero0"].estimate.memory["state"] / 3  # fp32 params + Adam's two moments = 3 gradients
    assert cpu["data=8 zero0"].estimate.memory["temporaries"] == pytest.approx(2 * grads, rel=1e-4)  # + the step count
    gpu = {s.candidate.label: s for s in search(work, tx, enumerate_candidates(8), PROFILES["H100"])}
    zero2 = gpu["fsdp=8 zero2"].estimate.memory["temporaries"]
    assert zero2 < cpu["fsdp=8 zero2"].estimate.memory["temporaries"]


def test_tensor_axis_that_does_not_divide_the_heads_is_not_a_candidate():
    _, _, by_label = scored(16)  # gpt-tiny has 4 heads
    tensors = {s.plan.mesh_shape["tensor"] for s in by_label.values()}
    assert tensors == {1, 2, 4}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gpt-tiny", "gpt"])
def test_the_cpu_profile_choice_and_every_prediction_are_pinned(name):
    """On the CPU profile (no native reduce-scatter, so no sequence-parallel candidate: the split would be an
    all-reduce and a slice) every enumerated candidate's predicted bytes are within 10% of its compiled step, and
    the choice stays plain data parallel (the pin that catches pricing meant for another backend leaking here).
    gpt-tiny's candidates are compiled by benchmarks/planner.py's quick mode (its asserted
    ``predicted_over_compiled_memory``, the same memory model: XLA:CPU's, no native reduce-scatter), so only its
    choice is pinned here."""
    init_fn, tx, batch = example_inputs(name)
    work = workload(init_fn, batch)
    _, report = choose_plan(init_fn, tx, batch, verify=False, device_profile=CPU)
    assert report.candidates[0].label == "data=8 zero0"
    cands = enumerate_candidates(8, sequence_parallel=CPU.native_reduce_scatter)
    assert not any(c.sequence_parallel for c in cands)
    if name == "gpt-tiny":  # its every candidate is compiled against its prediction by benchmarks/planner.py
        return
    ratios = {}
    for s in search(work, tx, cands, CPU):
        mesh = build_mesh(MeshConfig.from_sizes(dict(s.plan.mesh_shape)))
        ratios[s.candidate.label] = s.estimate.bytes / compiled_step_bytes(s.plan, work, tx, gpt_step, mesh)
    assert len(ratios) >= 18 and all(0.9 < r < 1.1 for r in ratios.values()), ratios
