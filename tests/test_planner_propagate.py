"""Tensor-parallel split of activations and matmuls: propagation rules vs closed forms and the compiled step."""

import jax
import jax.numpy as jnp
import optax
import pytest

from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.models.examples import example_inputs, gpt_step
from openhosti_jax.planner import PROFILES, choose_plan
from openhosti_jax.planner.propagate import propagate
from openhosti_jax.planner.refine import MEASURED_TIE, measured_order
from openhosti_jax.planner.search import Candidate, score
from openhosti_jax.planner.verify import compiled_step_bytes
from openhosti_jax.planner.workload import workload


def mlp(w1, w2, x):
    return jnp.tanh(x @ w1) @ w2


def test_column_then_row_marks_hidden_only():
    j = jax.make_jaxpr(mlp)(jnp.ones((8, 32)), jnp.ones((32, 8)), jnp.ones((4, 8)))
    dims, split_flops, resharded, cut = propagate(j.jaxpr, [1, 0, None], 2)
    hidden = [e.outvars[0] for e in j.jaxpr.eqns if e.primitive.name == "tanh"][0]
    assert dims[hidden] == 1  # (4, 32) split on its features
    assert dims[j.jaxpr.outvars[0]] is None  # row-parallel output: all-reduced, replicated
    assert split_flops == 2 * 4 * 8 * 32 * 2 and resharded == 0 and cut == 0  # both matmuls split, no regathering


def test_unsplit_params_mark_nothing():
    j = jax.make_jaxpr(mlp)(jnp.ones((8, 32)), jnp.ones((32, 8)), jnp.ones((4, 8)))
    dims, split_flops, *_ = propagate(j.jaxpr, [None, None, None], 2)
    assert split_flops == 0 and all(d is None for d in dims.values())


def test_reshape_to_heads_that_t_does_not_divide_reshards():
    def heads(w, x):
        return jnp.sum((x @ w).reshape(4, 2, 16), axis=2)

    j = jax.make_jaxpr(heads)(jnp.ones((8, 32)), jnp.ones((4, 8)))
    two, four = propagate(j.jaxpr, [1, None], 2), propagate(j.jaxpr, [1, None], 4)
    assert two.resharded == 0 and two.cut_reshapes == 0  # 2 | 2 heads: the split carries on
    assert four.resharded == 4 * 32 * 4  # 4 does not divide 2 heads: (4, 32) fp32 gathered
    assert four.cut_reshapes == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [{"data": 4, "tensor": 2}, {"fsdp": 2, "tensor": 4}])
def test_tensor_parallel_memory_matches_compiled(shape):
    init_fn, tx, batch = example_inputs("gpt-tiny")
    work = workload(init_fn, batch)
    sizes = {"stage": 1, "data": 1, "fsdp": 1, "tensor": 1, **shape}
    s = score(work, tx, Candidate(sizes, 1 if sizes["fsdp"] > 1 else 0), PROFILES["H100"])
    compiled = compiled_step_bytes(s.plan, work, tx, gpt_step, build_mesh(MeshConfig.from_sizes(sizes)))
    assert 0.9 < s.estimate.bytes / compiled < 1.1, (s.estimate.memory, compiled)


@pytest.mark.timeout(120)
def test_refine_with_only_pipelined_candidates_on_top_times_nothing():
    """A budget only pipelined meshes fit (the plain step has no stage axis to time): refine= says so."""
    init_fn, tx, batch = example_inputs("gpt-tiny")
    p, report = choose_plan(
        init_fn, tx, batch, memory_budget=1_600_000, pipeline=True, refine=2, step_fn=gpt_step, device_profile="H100"
    )
    assert p.pipeline_stages > 1 and report.compiled_bytes is None
    assert report.notes[0] == "refined: none of the top 2 predicted is unpipelined, so none was timed"


def test_measured_order_keeps_the_predicted_winner_inside_the_tie_band():
    assert measured_order([10.0, 9.85, 11.0], 0.02) == [0, 1, 2]
    assert measured_order([10.0, 11.0, 9.7], 0.02) == [2, 0, 1]
    assert measured_order([10.0, 10.5, 10.1], 0.02) == [0, 2, 1]
    assert measured_order([3.0], 0.02) == [0]


@pytest.mark.timeout(300)
def test_refine_times_top_candidates_and_keeps_the_fastest_beyond_the_tie_band():
    """The fastest measured of the top 2 wins only if it beats the predicted winner by more than MEASURED_TIE."""
    init_fn, tx, batch = example_inputs("gpt-tiny")
    _, predicted = choose_plan(init_fn, optax.adam(1e-3), batch, verify=False, device_profile="H100")
    p, report = choose_plan(init_fn, optax.adam(1e-3), batch, refine=2, step_fn=gpt_step, device_profile="H100")
    note = next(n for n in report.notes if n.startswith("refined"))
    timed = [part.rsplit(" ", 2) for part in note.split("measured ", 1)[1].split(", ")]
    ms = {label: float(t) for label, t, _ in timed}
    picked = note.split("picked ", 1)[1].split(";")[0]
    first = predicted.candidates[0].label
    assert first in ms
    fastest = min(ms, key=ms.get)
    assert len(ms) == 2 and picked == (fastest if ms[fastest] < ms[first] * (1 - MEASURED_TIE) else first), (
        note,
        first,
    )
    assert all(f"{a}={n}" in picked for a, n in p.mesh_shape.items() if n > 1) and picked.endswith(
        f"zero{p.zero_stage}"
    )
    assert report.compiled_bytes is not None
