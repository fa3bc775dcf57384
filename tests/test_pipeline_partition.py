"""The DP partitioner equals brute force; layer costs match closed forms; bad requests raise typed errors."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openhosti_jax.errors import PipelineError
from openhosti_jax.pipeline import (
    LayerCost,
    StageCostModel,
    evaluate_partition,
    layer_costs,
    partition,
)


def brute_force(costs, s, m, cap, objective, model):
    """Best objective value and min peak memory over every contiguous cut, by enumeration."""
    n = len(costs)
    best, lowest_mem = np.inf, np.inf
    for inner in itertools.combinations(range(1, n), s - 1):
        p = evaluate_partition(costs, (0, *inner, n), m, objective, model)
        lowest_mem = min(lowest_mem, max(p.stage_memory))
        if cap is None or max(p.stage_memory) <= cap:
            best = min(best, p.value)
    return best, lowest_mem


@st.composite
def problems(draw):
    n = draw(st.integers(1, 9))
    layers = []
    for _ in range(n):
        layers.append(
            LayerCost(
                flops=0.0,
                bytes_accessed=0.0,
                param_bytes=draw(st.integers(0, 50)),
                input_bytes=draw(st.integers(0, 20)),
                output_bytes=draw(st.integers(0, 20)),
                time_s=draw(st.one_of(st.integers(0, 6).map(float), st.floats(0.0, 10.0))),
            )
        )
    s = draw(st.integers(1, n))
    m = draw(st.integers(1, 8))
    cap = draw(st.one_of(st.none(), st.integers(0, 600).map(float)))
    model = StageCostModel(
        backward_ratio=draw(st.sampled_from([0.0, 2.0])),
        state_bytes_factor=draw(st.sampled_from([1.0, 4.0])),
        link_bandwidth=draw(st.sampled_from([None, 5.0])),
        schedule=draw(st.sampled_from(["gpipe", "1f1b"])),
    )
    return layers, s, m, cap, draw(st.sampled_from(["alpa", "max"])), model


@settings(max_examples=400, deadline=None)
@given(problems())
def test_dp_equals_brute_force(problem):
    costs, s, m, cap, objective, model = problem
    best, lowest_mem = brute_force(costs, s, m, cap, objective, model)
    if not np.isfinite(best):
        with pytest.raises(PipelineError, match="minimum achievable") as info:
            partition(costs, s, m, memory_cap=cap, objective=objective, model=model)
        assert f"{lowest_mem:.4g} bytes" in str(info.value)
        return
    p = partition(costs, s, m, memory_cap=cap, objective=objective, model=model)
    assert p.num_stages == s and p.num_layers == len(costs)
    assert p.value == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert cap is None or max(p.stage_memory) <= cap
    # the reported table is the cut's own evaluation
    assert p == evaluate_partition(costs, p.boundaries, m, objective, model)


def test_heterogeneous_embedding_and_big_head():
    # a cheap embedding, six equal blocks, a head as slow as three blocks: the head gets a stage alone
    times = [0.2] + [1.0] * 6 + [3.0]
    costs = [LayerCost(0, 0, 8, 4, 4, t) for t in times]
    p = partition(costs, 4, 8)
    assert p.boundaries[-2] == 7  # the head is alone
    equal = evaluate_partition(costs, (0, 2, 4, 6, 8), 8)
    assert p.max_stage_time < equal.max_stage_time
    assert "stage" in str(p) and "7-7" in str(p)


def test_more_stages_than_layers_names_the_most_achievable():
    costs = [LayerCost(0, 0, 1, 1, 1, 1.0)] * 3
    with pytest.raises(PipelineError, match="most stages achievable is 3"):
        partition(costs, 4, 2)


def test_memory_cap_error_names_minimum():
    costs = [LayerCost(0, 0, 100, 0, 0, 1.0)] * 4  # 400 B of state per layer at factor 4
    with pytest.raises(PipelineError, match="minimum achievable peak stage memory is 800 bytes"):
        partition(costs, 2, 2, memory_cap=700)
    assert max(partition(costs, 2, 2, memory_cap=800).stage_memory) == 800


def test_layer_costs_match_closed_form():
    layers = [lambda p, x: jnp.tanh(x @ p), lambda p, x: x @ p["w"] + p["b"]]
    params = [jnp.ones((8, 16)), {"w": jnp.ones((16, 4)), "b": jnp.zeros(4)}]
    c0, c1 = layer_costs(layers, params, jnp.ones((2, 8)), peak_flops=1e3, bandwidth=1e12)
    assert c0.flops == 2 * 2 * 8 * 16
    assert c1.flops >= 2 * 2 * 16 * 4
    assert c0.param_bytes == 8 * 16 * 4 and c1.param_bytes == (16 * 4 + 4) * 4
    assert (c0.input_bytes, c0.output_bytes, c1.input_bytes, c1.output_bytes) == (64, 128, 128, 32)
    assert c0.time_s == pytest.approx(c0.flops / 1e3)
