"""Tensor-parallel split of activations and matmuls: propagation rules vs closed forms and the compiled step."""

import jax
import jax.numpy as jnp
import pytest

from openhosti_jax.demo.examples import example_inputs, gpt_step
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.planner import PROFILES
from openhosti_jax.planner.propagate import propagate
from openhosti_jax.planner.search import Candidate, score
from openhosti_jax.planner.verify import compiled_step_bytes
from openhosti_jax.planner.workload import workload


def mlp(w1, w2, x):
    return jnp.tanh(x @ w1) @ w2


def test_column_then_row_marks_hidden_only():
    j = jax.make_jaxpr(mlp)(jnp.ones((8, 32)), jnp.ones((32, 8)), jnp.ones((4, 8)))
    dims, split_flops, resharded, cut, _ = propagate(j.jaxpr, [1, 0, None], 2)
    hidden = [e.outvars[0] for e in j.jaxpr.eqns if e.primitive.name == "tanh"][0]
    assert dims[hidden] == 1  # (4, 32) split on its features
    assert dims[j.jaxpr.outvars[0]] is None  # row-parallel output: all-reduced, replicated
    assert split_flops == 2 * 4 * 8 * 32 * 2 and resharded == 0 and cut == 0  # both matmuls split, no regathering


def test_a_value_kept_for_selective_remat_carries_its_split():
    """`keep` (a checkpoint name) is the identity: the split flows through it, nothing is regathered."""
    from openhosti_jax.policies.remat import keep

    j = jax.make_jaxpr(lambda w1, w2, x: keep(jnp.tanh(x @ w1)) @ w2)(
        jnp.ones((8, 32)), jnp.ones((32, 8)), jnp.ones((4, 8))
    )
    _, split_flops, resharded, *_ = propagate(j.jaxpr, [1, 0, None], 2)
    assert split_flops == 2 * 4 * 8 * 32 * 2 and resharded == 0


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


def test_a_split_matmul_consumes_its_unsplit_input_whole():
    """Column-parallel then row-parallel: x feeds a split matmul unsplit (under sequence parallelism it is
    all-gathered there and kept so), the hidden activation is split, and nothing else is consumed whole."""
    j = jax.make_jaxpr(mlp)(jnp.ones((8, 32)), jnp.ones((32, 8)), jnp.ones((4, 8)))
    whole = propagate(j.jaxpr, [1, 0, None], 2).whole
    assert whole == {j.jaxpr.invars[2]}
    scanned = jax.make_jaxpr(lambda w, x: jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), c), x, w))(
        jnp.ones((3, 8, 8)), jnp.ones((4, 8))
    )
    stacked = scanned.jaxpr.eqns[-1].outvars[1]  # each layer's input, stacked: what the backward keeps
    assert stacked in propagate(scanned.jaxpr, [2, None], 2).whole
