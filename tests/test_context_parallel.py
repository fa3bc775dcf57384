"""Context parallelism: the sequence split over the mesh's ``context`` axis, attention across the pieces (ring or
all-gather), against single-device runs of the same models."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax import MeshConfig, build_mesh, create_train_state, spmd
from openhosti_jax.demo.examples import gpt_step
from openhosti_jax.errors import BatchError, ConfigError, ShardingError
from openhosti_jax.flops import jaxpr_flops
from openhosti_jax.models.attention import causal_attention
from openhosti_jax.models.context import (
    _from_balanced,
    _to_balanced,
    context_attention,
    context_size,
    shard_positions,
)
from openhosti_jax.models.gpt import GPT, GPTConfig, next_token_loss
from openhosti_jax.models.llama import Llama, LlamaConfig

MESHES = {
    "context2": {"data": 4, "context": 2},
    "context4": {"data": 2, "context": 4},
    "context2-fsdp2-tensor2": {"fsdp": 2, "context": 2, "tensor": 2},
}


def _model(family: str, **kw) -> nnx.Module:
    if family == "gpt":
        return GPT(GPTConfig.tiny(**kw), rngs=nnx.Rngs(0))
    return Llama(LlamaConfig.tiny(**kw), rngs=nnx.Rngs(0))  # 4 query heads over 2 kv heads


def _loss(graphdef, params, tokens):
    total, count = next_token_loss(nnx.merge(graphdef, params)(tokens), tokens)
    return total / count


def _logits_and_grads(graphdef, params, tokens):
    logits = nnx.merge(graphdef, params)(tokens)
    return logits, jax.grad(_loss, argnums=1)(graphdef, params, tokens)


def _one_device(graphdef, params, tokens):
    one = jax.devices()[0]
    params, tokens = jax.device_put((params, tokens), one)
    return jax.device_get(jax.jit(_logits_and_grads, static_argnums=0)(graphdef, params, tokens))


def _on_mesh(graphdef, params, tokens, sizes):
    """Logits, gradients and the traced program of the model on a mesh of ``sizes``, tokens split over the batch
    axes and the sequence over ``context``."""
    mesh = build_mesh(MeshConfig.from_sizes(sizes))
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"), "context")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    fn = jax.jit(_logits_and_grads, static_argnums=0)
    with jax.set_mesh(mesh):
        text = str(fn.trace(graphdef, params, tokens).jaxpr)
        out = fn(graphdef, params, tokens)
    return jax.device_get(out), text


def _assert_close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _check_model(family, mesh, strategy, **kw):
    graphdef, params = nnx.split(_model(family, context_strategy=strategy, **kw))
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, 256)
    got, program = _on_mesh(graphdef, params, tokens, MESHES[mesh])
    assert ("ppermute" if strategy == "ring" else "all_gather") in program  # the context path ran
    _assert_close(got, _one_device(graphdef, params, tokens))


@pytest.mark.timeout(120)
def test_ring_attention_on_context2_equals_one_device():
    """Llama's forward logits and every parameter's gradient, fp32, within 1e-5 of one device (grouped-query, RoPE),
    the blocks scanned (one compiled block, the attention's shard_map inside ``nnx.scan``)."""
    _check_model("llama", "context2", "ring", scan_layers=True)


@pytest.mark.slow  # 12 models compiled on 8 devices: ~2.5 min on the 2-core machine
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_context_parallel_models_equal_one_device(family, mesh, strategy):
    """Both strategies on context=2, context=4 and context=2 x fsdp=2 x tensor=2 (heads split over tensor too)."""
    _check_model(family, mesh, strategy)


def _slow(*values):
    return pytest.param(*values, marks=[pytest.mark.slow, pytest.mark.timeout(120)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize(
    ("sizes", "heads", "axis_type"),
    [
        ({"data": 2, "context": 4}, (4, 2), "auto"),
        # the rest compile in ~20 s each: the slow suite
        _slow({"data": 2, "context": 4}, (4, 4), "auto"),
        _slow({"data": 2, "context": 4}, (8, 1), "auto"),
        _slow({"context": 2, "tensor": 4}, (4, 2), "auto"),  # 2 kv heads repeated over 4 tensor shards
        _slow({"data": 2, "context": 2, "tensor": 2}, (4, 2), "explicit"),
    ],
)
def test_context_attention_equals_causal_attention_with_gradients(strategy, sizes, heads, axis_type):
    """The attention alone: output and gradients of q, k, v within 1e-5 of `jax.nn.dot_product_attention`, with as
    many, half as many and one kv head per query head, heads split over tensor, on Auto and Explicit axes."""
    h, kvh = heads
    q = jax.random.normal(jax.random.key(0), (2, 32, h, 8))
    k, v = (jax.random.normal(jax.random.key(i), (2, 32, kvh, 8)) for i in (1, 2))

    def loss(f, q, k, v):
        return jnp.sum(jnp.sin(f(q, k, v)))

    def reference(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def split(q, k, v):
        return context_attention(q, k, v, strategy=strategy)

    mesh = build_mesh(MeshConfig.from_sizes(sizes, axis_type=axis_type))
    placed = jax.device_put((q, k, v), NamedSharding(mesh, P(("data", "fsdp"), "context")))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: (split(*a), jax.grad(loss, argnums=(1, 2, 3))(split, *a)))(*placed)
    if axis_type == "explicit":  # the output is placed back as q was
        assert tuple(got[0].sharding.spec)[:2] == (("data", "fsdp"), "context")
        assert all(e is None for e in tuple(got[0].sharding.spec)[2:])
    want = (reference(q, k, v), jax.grad(loss, argnums=(1, 2, 3))(reference, q, k, v))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
def test_the_non_context_path_equals_query_blocks_and_a_plain_softmax():
    """`jax.nn.dot_product_attention` (no block) and the blocked einsum agree with a plain masked softmax, GQA."""
    q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
    k, v = (jax.random.normal(jax.random.key(i), (2, 16, 2, 8)) for i in (1, 2))
    kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)  # query head h reads kv head h // 2
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(8)
    scores = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), scores, -jnp.inf)
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), vr)
    assert context_size() == 1
    for block in (None, 4, 16):
        np.testing.assert_allclose(causal_attention(q, k, v, block=block), want, rtol=1e-5, atol=1e-5)


def _pairs(positions: np.ndarray) -> list[int]:
    """Unmasked causal (query, key) pairs of each device: a query at position p sees p + 1 keys."""
    return [int(np.sum(p + 1)) for p in positions]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_balanced_layout_gives_every_device_equal_causal_work(n):
    """The ring's layout holds equal causal work per device where contiguous pieces do not; the layout the
    attention actually builds (its exchange, run on the positions) is that layout, and undoing it restores the
    order; and the ring's score matmuls per device are exactly that work plus the masked halves of its two causal
    diagonal blocks, none wholly masked."""
    s, c = 64, 64 // (2 * n)
    balanced, contiguous = _pairs(shard_positions(s, n)), _pairs(shard_positions(s, n, balanced=False))
    assert len(set(balanced)) == 1 and balanced[0] * n == s * (s + 1) // 2
    assert len(set(contiguous)) == n  # the last device has the most work, the first the least
    assert contiguous[0] < balanced[0] < contiguous[-1] and contiguous[-1] > 2 * contiguous[0]

    mesh = build_mesh(MeshConfig.from_sizes({"context": n}), jax.devices()[:n])
    positions = jnp.arange(s)[None]

    def roundtrip(x):
        moved = _to_balanced(x, "context", n)
        return moved, _from_balanced(moved, "context", n)

    spec = P(None, "context")
    moved, back = jax.jit(jax.shard_map(roundtrip, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))(positions)
    np.testing.assert_array_equal(np.asarray(moved).reshape(n, -1), shard_positions(s, n))
    np.testing.assert_array_equal(back, positions)

    b, h, d = 1, 2, 4
    q = jnp.ones((b, s, h, d))
    with jax.set_mesh(mesh):
        flops = jaxpr_flops(context_attention, q, q, q, matmul_only=True)  # the shard_map body: one device's
    scores = flops / (2 * 2 * d * b * h)  # two matmuls per score, 2 d FLOPs each
    assert scores == balanced[0] + c * (c - 1)


@pytest.mark.slow  # ~30 s each on the 2-core machine
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("family", "sizes", "strategy", "sequence_parallel"),
    [
        ("gpt", {"fsdp": 2, "context": 2, "tensor": 2}, "ring", True),
        ("llama", {"data": 2, "context": 4}, "all_gather", False),
    ],
)
def test_a_train_step_with_a_context_axis_equals_plain_jit_on_one_device(family, sizes, strategy, sequence_parallel):
    """Three Adam steps through create_train_state and @spmd (ZeRO-3; the plan splits the batch's sequence over
    context) give the losses of a plain jax.jit loop on one device from the same parameters. A plan that also asks
    for Megatron's sequence parallelism over tensor trains the same (the step leaves that split out under context:
    XLA miscompiled the weight gradients between the two splits, 0.5% off by the third step)."""
    model = _model(family, context_strategy=strategy)
    graphdef, _ = nnx.split(model)
    mesh = build_mesh(MeshConfig.from_sizes(sizes))
    tx = optax.adam(1e-2)
    state, plan = create_train_state(lambda r: _model(family, context_strategy=strategy), tx, mesh, plan="fsdp")
    assert plan.batch_spec == P(("data", "fsdp"), "context")
    plan = dataclasses.replace(plan, sequence_parallel=sequence_parallel)
    start = jax.device_get(state.params)
    step = spmd(gpt_step, mesh=mesh, plan=plan)
    batches = [jax.random.randint(jax.random.key(2), (8, 32), 0, 256)] * 3  # one batch: the loss must fall
    losses = []
    for tokens in batches:
        state, metrics = step(state, tokens)
        losses.append(float(metrics["loss"]))

    one = jax.devices()[0]
    params = jax.device_put(start, one)
    opt_state = tx.init(params)

    @jax.jit
    def plain(params, opt_state, tokens):
        value, grads = jax.value_and_grad(lambda p: _loss(graphdef, p, tokens))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    want = []
    for tokens in batches:
        params, opt_state, value = plain(params, opt_state, jax.device_put(tokens, one))
        want.append(float(value))
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-5)
    assert want[-1] < want[0]  # it trained


@pytest.mark.timeout(120)
def test_typed_errors():
    """A sequence the pieces do not divide, heads the tensor axis does not divide, no context axis, a bad
    strategy, and a batch whose sequence the plan's context split does not divide."""
    q = jnp.ones((2, 12, 4, 8))
    with jax.set_mesh(build_mesh(MeshConfig.from_sizes({"data": 2, "context": 4}))):
        with pytest.raises(
            ShardingError, match=r"cuts the sequence into 8 equal pieces, but the sequence length is 12"
        ):
            context_attention(q, q, q)
        assert context_attention(q, q, q, strategy="all_gather").shape == q.shape  # 12 = 3 x 4
        with pytest.raises(ShardingError, match=r"into 4 equal pieces, but the sequence length is 10"):
            context_attention(q[:, :10], q[:, :10], q[:, :10], strategy="all_gather")
        with pytest.raises(ShardingError, match=r"use a sequence length divisible by 8"):
            _model("llama")(jnp.zeros((2, 12), jnp.int32))  # the models' attention raises it too
        with pytest.raises(ConfigError, match=r"strategy in \('ring', 'all_gather'\), found 'tree'"):
            context_attention(q, q, q, strategy="tree")
    with jax.set_mesh(build_mesh(MeshConfig.from_sizes({"data": 2, "context": 2, "tensor": 2}))):
        q6 = jnp.ones((2, 16, 3, 8))
        with pytest.raises(ShardingError, match=r"splits the 3 query heads over the 'tensor' axis of size 2"):
            context_attention(q6, q6, q6)
    with pytest.raises(ShardingError, match=r"needs a mesh with a 'context' axis, found no mesh"):
        context_attention(q, q, q)
    with pytest.raises(ConfigError, match=r"context_strategy='tree' must be one of"):
        GPTConfig.tiny(context_strategy="tree")
    with pytest.raises(ConfigError, match=r"context_strategy='tree' must be one of"):
        LlamaConfig.tiny(context_strategy="tree")

    mesh = build_mesh(MeshConfig.from_sizes({"data": 2, "context": 4}))
    state, plan = create_train_state(lambda r: _model("gpt"), optax.sgd(0.1), mesh, plan="dp")
    with pytest.raises(
        BatchError, match=r"dim 1 of global size 30 is not divisible by the 4 shards of mesh axes context"
    ):
        spmd(gpt_step, mesh=mesh, plan=plan)(state, jnp.zeros((8, 30), jnp.int32))
