"""Collective matmuls: a sequence-parallel block's tensor-parallel collectives cut into ring steps beside the
matmuls (`openhosti_jax.models.collective`), equal to plain matmuls and to one device, priced as hidden only where
they run."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from openhosti_jax.demo.examples import gpt_step
from openhosti_jax.errors import ShardingError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.models.collective import gathered_matmuls, scattered_matmul
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.planner import PROFILES
from openhosti_jax.planner.cluster import cluster
from openhosti_jax.planner.search import Candidate, score
from openhosti_jax.planner.stacks import STACKS
from openhosti_jax.planner.workload import workload
from openhosti_jax.sharding import ShardingPlan
from openhosti_jax.train import create_train_state, spmd

NO_OVERLAP = dataclasses.replace(PROFILES["H100"], overlap=False)
"""A device that runs collectives and compute one after the other (as this machine's CPU profile does)."""


def _mesh(**sizes: int):
    return build_mesh(MeshConfig.from_sizes(sizes))


@pytest.mark.parametrize("sizes", [{"data": 2, "tensor": 4}, {"data": 2, "context": 2, "tensor": 2}])
def test_the_rings_equal_plain_matmuls_forward_and_backward(sizes):
    """Both rings against ``x @ w``: values and the gradients of every input, with a kernel ``tensor`` does not
    split (6 output features over 4) passed whole, and the sequence split over context too."""
    mesh, context = _mesh(**sizes), "context" if "context" in sizes else None
    x = jax.random.normal(jax.random.key(0), (4, 16, 8))
    w1, w2, w3 = (jax.random.normal(jax.random.key(i), shape) for i, shape in ((1, (8, 12)), (2, (8, 6)), (3, (12, 8))))

    def ring(x, w1, w2, w3):
        a, b = gathered_matmuls(x, (w1, w2), mesh, "data", context)
        return scattered_matmul(jnp.tanh(a), w3, mesh, "data", context), b

    def plain(x, w1, w2, w3):
        return jnp.tanh(x @ w1) @ w3, x @ w2

    def loss(f):
        return lambda *a: sum(jnp.sum(jnp.sin(y)) for y in f(*a))

    with jax.set_mesh(mesh):
        got = jax.jit(ring)(x, w1, w2, w3)
        grads = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2, 3)))(x, w1, w2, w3)
    for g, want in zip(got, plain(x, w1, w2, w3), strict=True):
        np.testing.assert_allclose(g, want, atol=1e-5, rtol=1e-5)
    for g, want in zip(grads, jax.grad(loss(plain), argnums=(0, 1, 2, 3))(x, w1, w2, w3), strict=True):
        np.testing.assert_allclose(g, want, atol=1e-4, rtol=1e-5)


def test_the_compiled_rings_move_pieces_instead_of_gathering():
    """Compiled on data=2 x tensor=4: no all-gather, reduce-scatter or all-reduce over the activations; n - 1
    collective-permutes per ring, and no ppermute of the gather ring carries a matmul's output (each hop is
    independent of the matmul beside it)."""
    mesh = _mesh(data=2, tensor=4)
    x, w = jnp.ones((4, 16, 8)), jnp.ones((8, 12))
    with jax.set_mesh(mesh):
        gather = jax.jit(lambda x, w: gathered_matmuls(x, (w,), mesh, "data")[0])
        scatter = jax.jit(lambda h, w: scattered_matmul(h, w, mesh, "data"))
        texts = [gather.lower(x, w).compile().as_text(), scatter.lower(x @ w, w.T).compile().as_text()]
        jaxpr = jax.make_jaxpr(gather)(x, w)
    for text in texts:
        assert text.count(" collective-permute(") + text.count(" collective-permute-start(") == 3, text
        for op in (" all-gather(", " reduce-scatter(", " all-reduce("):
            assert op not in text
    inner = next(e for e in jaxpr.eqns if e.primitive.name == "jit").params["jaxpr"].jaxpr
    body = next(e for e in inner.eqns if e.primitive.name == "shard_map").params["jaxpr"]
    produced_by_dot = {v for e in body.eqns if e.primitive.name == "dot_general" for v in e.outvars}
    permutes = [e for e in body.eqns if e.primitive.name == "ppermute"]
    assert len(permutes) == 3 and not any(v in produced_by_dot for e in permutes for v in e.invars)


def test_a_sequence_split_the_ring_cannot_divide_is_a_sharding_error():
    mesh = _mesh(data=2, tensor=4)
    with jax.set_mesh(mesh), pytest.raises(ShardingError, match="sequence"):
        gathered_matmuls(jnp.ones((2, 6, 8)), (jnp.ones((8, 4)),), mesh, "data")


def _llama(r):
    cfg = LlamaConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128)
    return Llama(cfg, rngs=nnx.Rngs(r))


def _gpt(r):
    return GPT(GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=128, dropout=0.0), rngs=nnx.Rngs(r))


def _train(init, mesh, plan, batches):
    state, plan = create_train_state(init, optax.adam(1e-3), mesh, plan=plan, seed=0)
    step = spmd(gpt_step, mesh=mesh, plan=plan)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.tree.map(np.asarray, jax.device_get(state.params))


@pytest.mark.parametrize(
    ("init", "sizes"),
    [
        pytest.param(_llama, {"data": 2, "tensor": 4}, marks=[pytest.mark.slow, pytest.mark.timeout(300)]),
        pytest.param(_gpt, {"data": 2, "tensor": 4}, marks=[pytest.mark.slow, pytest.mark.timeout(300)]),
        pytest.param(
            _llama, {"fsdp": 2, "context": 2, "tensor": 2}, marks=[pytest.mark.slow, pytest.mark.timeout(300)]
        ),
    ],
)
def test_a_collective_matmul_step_equals_one_device(init, sizes):
    """Three Adam steps with the blocks' projections as collective matmuls (sequence parallel, ZeRO-3 where fsdp)
    against the same steps on one device: losses within 1e-5 relative, parameters within 1e-4
    (a tenth of Adam's step)."""
    batches = jax.random.randint(jax.random.key(0), (3, 8, 32), 0, 128)
    mesh = _mesh(**sizes)
    shape = {a: sizes.get(a, 1) for a in ("stage", "data", "fsdp", "context", "tensor")}
    zero = 3 if shape["fsdp"] > 1 else 0
    work = workload(init, jax.ShapeDtypeStruct((8, 32), jnp.int32))
    plan = score(work, optax.adam(1e-3), Candidate(shape, zero, sequence_parallel=True), PROFILES["H100"]).plan
    assert plan.collective_matmul  # H100 overlaps collectives with compute: the planner asks for the rings
    one = build_mesh(MeshConfig.from_sizes({"data": 1}), jax.devices()[:1])
    ref = _train(init, one, ShardingPlan.from_zero(work.params, optax.adam(1e-3), dict(one.shape), 0), batches)
    got = _train(init, mesh, plan, batches)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    # Adam divides by the root of a gradient's second moment, so an element whose gradient nearly cancels moves by
    # up to lr per step whatever its rounding: 3 steps at lr 1e-3 allow 1e-4 (the vocabulary-parallel embedding sums
    # its pieces in another order than one device's lookup)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4), got[1], ref[1])


def test_the_planner_prices_the_rings_as_hidden_only_where_they_run():
    """On H100 this library's sequence-parallel, unpipelined plans run collective matmuls and expose no tensor
    collective time; pipelined ones, devices without overlap and a stack without them expose it all."""
    work = workload(_llama, jax.ShapeDtypeStruct((64, 32), jnp.int32))
    tx = optax.adam(1e-3)
    flat = {"stage": 1, "data": 2, "fsdp": 1, "context": 1, "tensor": 4}
    piped = dict(flat, stage=2, data=1)
    own, titan = cluster("8xH100"), dataclasses.replace(cluster("8xH100"), stack=STACKS["torchtitan-compile"])

    def run(sizes, where):
        return score(work, tx, Candidate(sizes, 0, sequence_parallel=True), where)

    ring = run(flat, own)
    assert ring.plan.collective_matmul and ring.estimate.time["exposed"] == 0.0
    for sizes, where in ((piped, own), (flat, NO_OVERLAP), (flat, titan)):
        s = run(sizes, where)
        assert not s.plan.collective_matmul
        assert s.estimate.time["exposed"] > 0
    exposed = run(flat, titan).estimate
    assert exposed.time["exposed"] > 0 and exposed.time["collectives"] == pytest.approx(
        ring.estimate.time["collectives"], rel=0.05
    )


def test_a_context_split_keeps_the_sequence_split_only_with_the_rings():
    """This library runs the tensor axis's sequence split beside a context split only through collective matmuls:
    on a device without overlap (no rings) a context x tensor candidate is scored without it; on H100 with it."""
    work = workload(_llama, jax.ShapeDtypeStruct((2, 32), jnp.int32))
    sizes = {"stage": 1, "data": 1, "fsdp": 1, "context": 2, "tensor": 4}
    c = Candidate(sizes, 0, sequence_parallel=True)
    assert not score(work, optax.adam(1e-3), c, NO_OVERLAP).plan.sequence_parallel
    gpu = score(work, optax.adam(1e-3), c, cluster("8xH100")).plan
    assert gpu.sequence_parallel and gpu.collective_matmul


def test_a_plan_asking_for_rings_without_a_sequence_split_is_a_sharding_error():
    with pytest.raises(ShardingError, match="collective_matmul"):
        ShardingPlan.from_zero({}, None, {"tensor": 8}, 0, collective_matmul=True)
