"""Packed sequences: documents packed into rows by segment ids give, on every attention path, what the documents
give run one by one (outputs, gradients, the models' loss), and segment ids of the wrong shape are a typed error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from openhosti_jax.errors import BatchError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.models.attention import causal_attention
from openhosti_jax.models.context import _finish, _merge, _splash_block, _xla_block, context_attention
from openhosti_jax.models.gpt import GPT, GPTConfig, next_token_loss
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.models.splash import splash_attention


def packed_ids(lengths: list[list[int]]) -> np.ndarray:
    """Segment ids of rows packed with documents of these lengths (ids 1, 2, ... per row; a short row padded 0)."""
    s = max(sum(row) for row in lengths)
    out = np.zeros((len(lengths), s), np.int32)
    for r, row in enumerate(lengths):
        out[r, : sum(row)] = np.repeat(np.arange(1, len(row) + 1), row)
    return out


def runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document (padding included: it attends within itself too)."""
    out = []
    for r, row in enumerate(ids):
        edges = [0, *np.flatnonzero(np.diff(row)) + 1, len(row)]
        out += [(r, a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return out


def one_by_one(q, k, v, ids):
    """The reference: each document's causal attention on its own, put back in place."""
    out = jnp.zeros_like(q)
    for r, a, b in runs(ids):
        doc = jax.nn.dot_product_attention(q[r : r + 1, a:b], k[r : r + 1, a:b], v[r : r + 1, a:b], is_causal=True)
        out = out.at[r : r + 1, a:b].set(doc)
    return out


def qkv(b, s, heads=4, kv_heads=2, d=16, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(
        jax.random.normal(key, (b, s, h, d), dtype) for key, h in zip(keys, (heads, kv_heads, kv_heads), strict=True)
    )


def check_against_reference(attend, q, k, v, ids, atol=2e-5):
    """Outputs and the gradients of a weighted sum of them, packed against one by one (each jitted once)."""
    w = jax.random.normal(jax.random.key(9), q.shape)

    def run(fn):
        def value(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(out * w), out

        return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (got, out), got_g = run(attend)
    (want, ref), want_g = run(lambda q, k, v: one_by_one(q, k, v, ids))
    np.testing.assert_allclose(out, ref, atol=atol)
    assert float(got) == pytest.approx(float(want), rel=1e-4)
    for g, r in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, r, atol=10 * atol)


LENGTHS = [[40, 24, 56, 8], [128]]  # the first row 4 documents, the second one


@pytest.mark.parametrize("block", [None, 32])
def test_xla_and_query_blocks_keep_documents_apart(block):
    ids = packed_ids(LENGTHS)
    q, k, v = qkv(2, 128)
    attend = functools.partial(causal_attention, block=block, kernel="xla", segment_ids=jnp.asarray(ids))
    check_against_reference(attend, q, k, v, ids)


def test_the_splash_kernel_keeps_documents_apart():
    ids = packed_ids(LENGTHS)
    q, k, v = qkv(2, 128)
    seg = jnp.asarray(ids)
    check_against_reference(
        lambda q, k, v: splash_attention(q, k, v, interpret=True, segment_ids=(seg, seg)), q, k, v, ids
    )


def test_the_rings_splash_blocks_weigh_nothing_where_a_query_sees_no_key():
    """A ring step's block by the splash kernel with segment ids, merged into the running result as the ring merges
    it, against the same by XLA's masked einsums: equal outputs and gradients, rows that see none of the block's
    keys (the first document's) included."""
    c = 128
    seg_q = jnp.asarray(packed_ids([[40, 88]]))  # the block's queries: documents 1 and 2
    seg_k = jnp.full((1, c), 2, jnp.int32)  # the block's keys, all earlier tokens of document 2
    q = jax.random.normal(jax.random.key(0), (1, c, 2, 2, 64))  # (b, q, kv heads, group, d)
    k, v = (jax.random.normal(jax.random.key(i), (1, c, 2, 64)) for i in (1, 2))
    kd, vd = (jax.random.normal(jax.random.key(i), (1, c, 2, 64)) for i in (3, 4))  # the queries' own chunk

    def merged(attend):
        def out(q, k, v):
            diag = attend(q, kd, vd, True, (seg_q, seg_q))
            return _finish(_merge(diag, attend(q, k, v, False, (seg_q, seg_k))), jnp.float32)

        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(out(*a) ** 2), argnums=(0, 1, 2)))(q, k, v)

    scale = 64**-0.5
    (got, got_g), (want, want_g) = merged(_splash_block(scale, True)), merged(_xla_block(scale))
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for g, r in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_attention_keeps_documents_apart(strategy):
    """The ring's key blocks that hold none of a query's document weigh nothing; the ids travel with the keys."""
    mesh = build_mesh(MeshConfig.from_sizes({"context": 2}), jax.devices()[:2])
    ids = packed_ids([[3, 10, 3], [9, 7]])  # documents cross the ring's chunks of 4
    q, k, v = qkv(2, 16)
    seg = jnp.asarray(ids)
    with jax.set_mesh(mesh):
        check_against_reference(functools.partial(context_attention, strategy=strategy, segment_ids=seg), q, k, v, ids)


def packed_over_separate(model, tokens: np.ndarray, ids: np.ndarray) -> float:
    """The packed rows' loss per target over their documents' loss per target, each document run alone (those of
    one length as one batch), both jitted."""
    graphdef, weights = nnx.split(model)
    call = jax.jit(lambda w, t, seg: next_token_loss(nnx.merge(graphdef, w)(t, segment_ids=seg), t, None, seg))
    total, count = call(weights, jnp.asarray(tokens), jnp.asarray(ids))
    alone = jax.jit(lambda w, t: next_token_loss(nnx.merge(graphdef, w)(t), t))
    docs: dict[int, list[np.ndarray]] = {}
    for r, a, b in runs(ids):
        if ids[r, a]:  # padding is no document
            docs.setdefault(b - a, []).append(tokens[r, a:b])
    sums = [alone(weights, jnp.asarray(np.stack(group))) for group in docs.values()]
    assert float(count) == sum(float(c) for _, c in sums)
    return (float(total) / float(count)) / (sum(float(t) for t, _ in sums) / float(count))


@pytest.mark.parametrize(
    "make",
    [
        lambda: GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)),
        lambda: GPT(GPTConfig.tiny(scan_layers=True, attention_block=8), rngs=nnx.Rngs(0)),
        lambda: Llama(LlamaConfig.tiny(seq_len=32), rngs=nnx.Rngs(0)),
    ],
    ids=["gpt", "gpt-scanned-blocks", "llama"],
)
def test_a_packed_models_loss_is_its_documents_run_one_by_one(make):
    ids = packed_ids([[8, 16, 8], [16, 8]])  # the second row ends in 8 tokens of padding
    tokens = np.random.default_rng(0).integers(0, 200, ids.shape).astype(np.int32)
    assert packed_over_separate(make(), tokens, ids) == pytest.approx(1.0, abs=1e-5)


def test_segment_ids_of_another_shape_are_a_typed_error():
    model = GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(BatchError, match=r"tokens' shape \(2, 16\).*found shape \(2, 15\)"):
        model(jnp.zeros((2, 16), jnp.int32), segment_ids=jnp.zeros((2, 15), jnp.int32))
    with pytest.raises(BatchError, match="integer dtype"):
        model(jnp.zeros((2, 16), jnp.int32), segment_ids=jnp.zeros((2, 16), jnp.float32))
