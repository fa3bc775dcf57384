"""The Pallas splash attention kernel (openhosti_jax.models.splash), run on CPU in Pallas's interpreter, against
attention written out as a softmax of einsums in float32: causal, grouped-query, forward and gradients, alone, as
the context axis's ring and all-gather blocks, and inside a Llama; and which kernel a model runs where."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from openhosti_jax.errors import ConfigError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.models.attention import attention_kernel, causal_attention, mesh_platform
from openhosti_jax.models.gpt import next_token_loss
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.models.splash import block_size, splash_attention, splash_problem, splash_stats
from openhosti_jax.planner.verify import lower_step
from openhosti_jax.planner.workload import workload
from openhosti_jax.sharding.plan import ShardingPlan

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
"""Max relative error (max |got - want| / max |want|, per output) allowed against the float32 reference."""


def _reference(q, k, v):
    """Causal grouped-query attention as a float32 softmax of einsums (query head h reads kv head h // group)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    b, s, h, d = q.shape
    g = h // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _inputs(dtype, b=2, s=256, h=4, kvh=2, d=64):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d)).astype(dtype)
    k, v = (jax.random.normal(x, (b, s, kvh, d)).astype(dtype) for x in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], (b, s, h, d), jnp.float32)


def _out_and_grads(fn, q, k, v, ct):
    """The output and (dq, dk, dv) of ``sum(fn(q, k, v) * ct)``, in float32."""
    out, vjp = jax.vjp(fn, q, k, v)
    return [x.astype(jnp.float32) for x in (out, *vjp(ct.astype(out.dtype)))]


def _max_rel(got, want):
    return max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_equals_a_float32_softmax_forward_and_gradients(dtype):
    q, k, v, ct = _inputs(dtype)
    got = jax.jit(lambda *a: _out_and_grads(lambda *x: splash_attention(*x, interpret=True), *a))(q, k, v, ct)
    want = _out_and_grads(_reference, q, k, v, ct)  # float32 from the same (rounded) inputs
    assert _max_rel(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("causal", [False, True])
def test_a_blocks_log_sum_exp_has_a_gradient(causal):
    """`splash_stats` differentiates its log-sum-exp too (the kernel's own VJP cannot): a loss of both outputs of a
    block, all keys visible or causal, against the same written out."""
    q, k, v, _ = _inputs("float32", s=128)
    grouped = q.reshape(2, 128, 2, 2, 64)
    w = jax.random.normal(jax.random.key(5), (2, 128, 2, 2))

    def loss(stats):
        lse, _, out = stats
        return jnp.sum(lse * w) + jnp.sum(jnp.tanh(out))

    def ref(q, k, v):
        s = jnp.einsum("bqngd,bknd->bqngk", q, k) / 8.0
        s = jnp.where(jnp.tril(jnp.ones((128, 128), bool))[None, :, None, None] | (not causal), s, -jnp.inf)
        return jax.nn.logsumexp(s, axis=-1), None, jnp.einsum("bqngk,bknd->bqngd", jax.nn.softmax(s, -1), v)

    got = jax.jit(jax.grad(lambda *a: loss(splash_stats(*a, causal, 0.125, interpret=True)), argnums=(0, 1, 2)))
    want = jax.jit(jax.grad(lambda *a: loss(ref(*a)), argnums=(0, 1, 2)))
    assert _max_rel(got(grouped, k, v), want(grouped, k, v)) <= 1e-5


@pytest.mark.parametrize(
    ("sizes", "strategy", "axis_type"),
    [
        ({"data": 2, "context": 2}, "ring", "auto"),
        ({"context": 2, "tensor": 4}, "all_gather", "auto"),
        ({"data": 2, "context": 2}, "all_gather", "explicit"),
        ({"data": 2, "tensor": 2}, "ring", "explicit"),  # no context axis: the kernel alone inside shard_map
    ],
)
def test_under_a_mesh_the_kernel_equals_a_float32_softmax(sizes, strategy, axis_type):
    """Under a context axis the ring's blocks (online softmax merged through their log-sum-exp) and the
    all-gather strategy's queries over the gathered keys (its block mask split over the axis) run the kernel; the
    tensor axis splitting more ways than there are kv heads repeats them; Explicit axes have their inputs resharded
    into the kernel's layout (its block mask too)."""
    q, k, v, ct = _inputs("float32", s=512)
    config = MeshConfig.from_sizes(sizes, axis_type=axis_type)
    mesh = build_mesh(config, jax.devices()[: int(np.prod(list(sizes.values())))])
    fn = jax.jit(
        lambda *a: _out_and_grads(lambda *x: causal_attention(*x, context_strategy=strategy, kernel="splash"), *a)
    )
    with jax.set_mesh(mesh):
        assert "pallas_call" in str(fn.trace(q, k, v, ct).jaxpr)
        got = fn(q, k, v, ct)
    assert _max_rel(got, _out_and_grads(_reference, q, k, v, ct)) <= TOLERANCE["float32"]


def _llama_loss_and_grads(dtype, kernel):
    cfg = LlamaConfig.tiny(seq_len=256, d_model=128, n_heads=2, n_kv_heads=1, ffn=128, dtype=dtype)
    graphdef, params = nnx.split(Llama(dataclasses.replace(cfg, attention_kernel=kernel), rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 256), 0, cfg.vocab_size)

    def loss(p):
        total, count = next_token_loss(nnx.merge(graphdef, p)(tokens), tokens)
        return total / count

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return [value, *jax.tree.leaves(grads)]


SLOW_BF16 = pytest.param("bfloat16", marks=[pytest.mark.slow, pytest.mark.timeout(300)])


@pytest.mark.parametrize("dtype", ["float32", SLOW_BF16])
def test_a_llama_through_the_kernel_has_the_xla_paths_loss_and_gradients(dtype):
    """A 2-layer Llama (2 query heads over 1 kv head, 256 tokens): loss and every gradient through the splash kernel
    against the XLA path in float32 (the reference); in bf16 both are held to the float32 reference, the kernel
    within 1.5 x the XLA path's own bf16 error (model-level bf16 rounding, not the kernel's, sets that floor)."""
    want = _llama_loss_and_grads("float32", "xla")
    got = _llama_loss_and_grads(dtype, "splash")
    if dtype == "float32":
        assert _max_rel(got, want) <= 1e-5
        return
    floor = _max_rel(_llama_loss_and_grads(dtype, "xla"), want)
    assert _max_rel(got, want) <= max(1.5 * floor, TOLERANCE[dtype])


@pytest.mark.parametrize(
    ("kernel", "dtype", "seq_len", "backend", "expected"),
    [
        ("auto", jnp.bfloat16, 8192, "tpu", "splash"),
        ("auto", jnp.float32, 256, "tpu", "splash"),
        ("auto", jnp.float16, 8192, "tpu", "xla"),  # fp16 does not compile for TPU (Mosaic rejects its loads)
        ("auto", jnp.bfloat16, 200, "tpu", "xla"),  # no block of 128 divides it
        ("auto", jnp.bfloat16, 8192, "cpu", "xla"),  # the interpreter only when asked for
        ("splash", jnp.float32, 256, "cpu", "splash"),
        ("xla", jnp.bfloat16, 8192, "tpu", "xla"),
    ],
)
def test_which_kernel_runs(kernel, dtype, seq_len, backend, expected):
    assert attention_kernel(kernel, dtype, 128, backend, seq_len) == expected


def test_a_shape_or_backend_the_kernel_cannot_take_is_a_typed_error():
    with pytest.raises(ConfigError, match=r"splash.*multiples of 128.*found sequence length 200.*'auto'"):
        attention_kernel("splash", jnp.bfloat16, 128, "tpu", 200)
    with pytest.raises(ConfigError, match="found dtype float16.*XLA's attention"):
        attention_kernel("splash", jnp.float16, 128, "tpu", 256)
    with pytest.raises(ConfigError, match="head dim of at most 512; found head dim 1024"):
        attention_kernel("splash", jnp.bfloat16, 1024, "tpu", 256)
    with pytest.raises(ConfigError, match="found backend 'gpu'"):
        attention_kernel("splash", jnp.bfloat16, 128, "gpu", 256)
    with pytest.raises(ConfigError, match="multiple of 128, found 200"):
        block_size(200)
    model = Llama(LlamaConfig.tiny(attention_kernel="splash"), rngs=nnx.Rngs(0))  # 32 tokens: no block fits
    with pytest.raises(ConfigError, match="attention_kernel='splash'.*sequence length 32"):
        model(jnp.zeros((1, 32), jnp.int32))
    mesh = build_mesh(MeshConfig.from_sizes({"context": 4}), jax.devices()[:4])
    q = jnp.zeros((1, 512, 2, 64))
    pieces = "sequence length 64 .* in the 8 context pieces of the sequence of 512"  # the ring's: 512 / (2 x 4)
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match=pieces):
        causal_attention(q, q, q, kernel="splash")
    assert splash_problem(256, jnp.bfloat16, 128) is None


def test_the_platform_comes_from_the_mesh_in_use():
    """Inside a trace under a mesh the platform is the mesh's devices', not the default backend's."""
    seen = []
    mesh = build_mesh(MeshConfig.from_sizes({"data": 2}), jax.devices()[:2])
    with jax.set_mesh(mesh):
        jax.eval_shape(lambda x: seen.append(mesh_platform()) or x, jnp.zeros(2))
    assert seen == ["cpu"] and mesh_platform(mesh) == "cpu"


def _tpu_devices():
    """4 abstract TPU v5p chips to compile for (no TPU attached), or a skip without libtpu (the tpu extra)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: no ahead-of-time compile for TPU")
    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on this machine may hold libtpu too

    return topologies.get_topology_desc(
        platform="tpu", topology_name="v5p:2x2x1", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1)
    ).devices


@pytest.mark.parametrize(("kernel", "custom_calls"), [("auto", True), ("xla", False)])
def test_the_llama_step_lowered_for_a_tpu_mesh_runs_the_kernel(kernel, custom_calls):
    """The library's own step (`lower_step`: the plan's shardings, AdamW) of a scanned bf16 Llama lowered from this
    CPU process for 4 TPU v5p chips: under ``"auto"`` its program holds the kernel's Mosaic custom calls (forward,
    dkv and dq passes), under ``"xla"`` none; the planner's trace of the same model (no mesh: this process's CPU)
    holds none either, its attention priced from the einsums it would run as XLA ops."""
    import optax

    from openhosti_jax.demo.examples import gpt_step

    cfg = LlamaConfig.tiny(seq_len=256, d_model=128, n_heads=2, n_kv_heads=1, ffn=128, dtype="bfloat16")
    cfg = dataclasses.replace(cfg, scan_layers=True, attention_kernel=kernel)
    work = workload(lambda r: Llama(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((4, 256), jnp.int32))
    tx = optax.adamw(1e-3)
    plan = ShardingPlan.from_zero(work.params, tx, {"data": 4}, 0)
    mesh = build_mesh(MeshConfig.from_sizes(plan.mesh_shape), _tpu_devices())
    assert mesh_platform(mesh) == "tpu" and jax.default_backend() == "cpu"
    text = lower_step(plan, work, tx, gpt_step, mesh).as_text()
    assert ("tpu_custom_call" in text) is custom_calls
    assert text.count("tpu_custom_call") == (3 if custom_calls else 0)
    assert "pallas" not in str(work.jaxpr)
