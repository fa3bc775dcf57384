"""Sequence parallelism: the activations between repeated blocks split over the tensor axis along the sequence."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from openhosti_jax.demo.examples import gpt_step
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.planner import PROFILES
from openhosti_jax.planner.profiles import XLA_CPU
from openhosti_jax.planner.search import Candidate, enumerate_candidates, score
from openhosti_jax.planner.verify import lower_step, memory_bytes
from openhosti_jax.planner.workload import workload
from openhosti_jax.train import create_train_state, spmd

SIZES = {"stage": 1, "data": 2, "fsdp": 1, "tensor": 4}
# an H100's links (its plans split the sequence: a native reduce-scatter) and the memory of the compiler that
# compiles here, XLA:CPU's (`CompilerMemory`)
H100_ON_XLA_CPU = dataclasses.replace(PROFILES["H100"], memory=XLA_CPU)
GPT_CFG = GPTConfig(n_layers=4, d_model=256, n_heads=8, seq_len=256, vocab_size=512, scan_layers=True)


def _init(family: str):
    if family == "gpt":
        return lambda r: GPT(GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=128), rngs=nnx.Rngs(r))
    cfg = LlamaConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn=128)
    return lambda r: Llama(cfg, rngs=nnx.Rngs(r))


@pytest.mark.slow  # 68 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_sequence_parallel_step_equals_the_tensor_parallel_one(family):
    """Two steps of the same model, data=2 x tensor=4, with and without the sequence split: the same losses and
    parameters (to float rounding: the reductions run in another order)."""
    init, tx = _init(family), optax.sgd(0.1)  # updates proportional to the gradients (Adam amplifies rounding)
    tokens = jax.random.randint(jax.random.key(0), (2, 8, 32), 0, 128)
    mesh = build_mesh(MeshConfig.from_sizes(SIZES))
    work = workload(init, jax.ShapeDtypeStruct((8, 32), jnp.int32))
    plan = score(work, tx, Candidate(SIZES, 0, remat="dots"), PROFILES["H100"]).plan
    runs, gathers = [], []
    for sequence in (False, True):
        p = dataclasses.replace(plan, sequence_parallel=sequence)
        gathers.append(lower_step(p, work, tx, gpt_step, mesh).compile().as_text().count(" all-gather("))
        state, p = create_train_state(init, tx, mesh, plan=p, seed=0)
        step = spmd(gpt_step, mesh=mesh, plan=p)
        losses = []
        for batch in tokens:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs.append((losses, jax.tree.map(np.asarray, jax.device_get(state.params))))
    assert gathers[1] > gathers[0]  # the split blocks gather their sequence back for the matmuls
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), runs[0][1], runs[1][1])


@pytest.mark.slow  # 15 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
def test_the_sequence_split_saves_what_the_cost_model_predicts():
    """Compiled on 8 CPU devices under remat "dots": the split keeps less than the tensor split alone, with XLA's
    partitioner placing it and with the collective matmuls an H100 plan runs (`models.collective`), and each
    prediction (every saved activation divided by the tensor axis) is within 10% of the compiled bytes."""
    init = lambda r: GPT(GPT_CFG, rngs=nnx.Rngs(r))  # noqa: E731
    tx = optax.adam(1e-3)
    work = workload(init, jax.ShapeDtypeStruct((16, 256), jnp.int32))
    mesh = build_mesh(MeshConfig.from_sizes(SIZES))
    got = {}
    for sequence, rings in ((False, False), (True, False), (True, True)):
        s = score(work, tx, Candidate(SIZES, 0, remat="dots", sequence_parallel=sequence), H100_ON_XLA_CPU)
        assert s.plan.collective_matmul == sequence  # H100 overlaps collectives: the planner asks for the rings
        plan = dataclasses.replace(s.plan, collective_matmul=rings)
        compiled = memory_bytes(lower_step(plan, work, tx, gpt_step, mesh).compile())
        got[sequence, rings] = (s.estimate.bytes, compiled)
        assert 0.9 < s.estimate.bytes / compiled < 1.1, (sequence, rings, s.estimate.memory, compiled)
    assert got[True, False][1] < 0.85 * got[False, False][1]  # compiled: the split saves memory
    assert got[True, True][1] < got[False, False][1]  # with the rings too
    assert got[True, False][0] < got[False, False][0]


def test_the_planner_splits_the_sequence_wherever_it_splits_tensors():
    """This library's pipeline stages split their layers over tensor (as Megatron's do), so its pipelined meshes
    have tensor axes, sequence parallel like the rest; a stack whose stages split only the batch gets none."""
    own = enumerate_candidates(16, pipeline=True, precisions=("bf16",))
    assert [c for c in own if c.mesh_shape["stage"] > 1 and c.mesh_shape["tensor"] > 1]
    batch_only = enumerate_candidates(16, pipeline=True, precisions=("bf16",), pipeline_tensor=False)
    assert not [c for c in batch_only if c.mesh_shape["stage"] > 1 and c.mesh_shape["tensor"] > 1]
    for c in own + batch_only:
        assert c.sequence_parallel == (c.mesh_shape["tensor"] > 1)


def test_the_split_moves_the_same_bytes_as_a_reduce_scatter_and_an_all_gather():
    """Megatron's accounting: an all-reduce is a reduce-scatter and an all-gather, so the split moves as many bytes
    over the tensor axis as the all-reduce it replaces, and keeps 1/t of the activations the tensor split left."""
    work = workload(lambda r: GPT(GPT_CFG, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((16, 256), jnp.int32))
    sizes = {"stage": 1, "data": 1, "fsdp": 1, "tensor": 8}
    e = [
        score(work, optax.adam(1e-3), Candidate(sizes, 0, sequence_parallel=s), PROFILES["H100"]).estimate
        for s in (False, True)
    ]
    assert e[1].comm_bytes == pytest.approx(e[0].comm_bytes)
    assert e[1].memory["state"] == e[0].memory["state"] and e[1].memory["temporaries"] < e[0].memory["temporaries"]
