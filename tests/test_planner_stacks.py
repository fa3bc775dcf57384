"""Software stacks in the cost model: each trait priced as its closed form, from the trace's own counts."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from openhosti_jax.errors import PlanningError
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.models.presets import model_preset
from openhosti_jax.planner.cluster import Cluster
from openhosti_jax.planner.cost import matmul_efficiency
from openhosti_jax.planner.predict import predict
from openhosti_jax.planner.profiles import PROFILES
from openhosti_jax.planner.search import Candidate, enumerate_candidates, rank, score, search
from openhosti_jax.planner.stacks import STACKS, Stack, stack
from openhosti_jax.planner.workload import workload

H100 = PROFILES["H100"]
CFG = GPTConfig(n_layers=2, d_model=256, n_heads=4, seq_len=128, vocab_size=512)
BATCH = jax.ShapeDtypeStruct((16, 128), jnp.int32)


def _gpt(cfg: GPTConfig = CFG, batch: jax.ShapeDtypeStruct = BATCH):
    return workload(lambda r: GPT(cfg, rngs=nnx.Rngs(r)), batch)


def _cluster(**traits) -> Cluster:
    """This library's stack with ``traits``, its attention kernel's on every device and precision (the tests price
    fp32 steps)."""
    own = dataclasses.replace(STACKS["openhosti"], attention_on=None, attention_half_only=False)
    return Cluster(H100, 1, 8, dataclasses.replace(own, **traits))


def _mesh(**axes) -> dict[str, int]:
    return {"stage": 1, "data": 1, "fsdp": 1, "tensor": 1} | axes


def test_scores_and_elementwise_bytes_are_counted_from_the_trace():
    """Scores: layers x heads x seq^2 (GQA: the query heads); elementwise bytes: each op's inputs and outputs."""
    assert _gpt().attention_work().score_elements == 2 * 4 * 128 * 128
    cfg = LlamaConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=3, n_heads=8, n_kv_heads=2, ffn=256)
    w = workload(lambda r: Llama(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((2, 64), jnp.int32))
    a = w.attention_work()
    assert a.score_elements == 3 * 8 * 64 * 64 and a.masked and 0 < a.attention_share < 1

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.w = nnx.Param(jnp.ones((32, 64)))

        def __call__(self, x):  # a matmul, then elementwise ops on (64,) per example
            return 2.0 * jnp.tanh(x @ self.w[...])

    net = workload(Net(nnx.Rngs(0)), jax.ShapeDtypeStruct((4, 32), jnp.float32)).attention_work()
    # the forward with its residuals runs tanh, 1 - tanh (what tanh's VJP keeps) and the scaling by 2 (a literal):
    # each reads 64 floats and writes 64
    assert net.elementwise_bytes == 3 * 2 * 64 * 4 and net.score_elements == 0 and not net.masked


def test_an_exposed_tensor_all_reduce_adds_to_the_step_and_an_overlapped_one_hides():
    w = _gpt()
    c = Candidate(_mesh(tensor=8), 0)
    waits = score(w, optax.adam(1e-3), c, _cluster(tensor_overlap=False)).estimate.time
    hides = score(w, optax.adam(1e-3), c, _cluster(tensor_overlap=True)).estimate.time
    work = waits["compute"] + waits["memory"] + waits["offload"] + waits["bubble"]
    assert waits["exposed"] > 0 and hides["exposed"] == 0
    assert waits["total"] == pytest.approx(max(work, waits["collectives"] - waits["exposed"]) + waits["exposed"])
    assert hides["total"] == pytest.approx(max(work, hides["collectives"]))
    assert waits["total"] > hides["total"]


def test_a_gradient_reduction_after_the_backward_adds_its_time():
    w = _gpt()
    c = Candidate(_mesh(data=8), 0)
    after = score(w, optax.adam(1e-3), c, _cluster(grad_overlap=False)).estimate.time
    work = after["compute"] + after["memory"] + after["offload"] + after["bubble"]
    assert after["collectives"] > 0 and after["exposed"] == pytest.approx(after["collectives"])  # all gradients
    assert after["total"] == pytest.approx(work + after["collectives"])


def test_eager_ops_and_materialised_scores_are_memory_traffic():
    """Against the fused stack, at remat "none" in fp32: eager adds each elementwise op's bytes three times (the
    forward, a backward of twice its traffic) in place of the saved activations' write and read; a stack that
    materialises scores adds its bytes per score element."""
    w = _gpt()
    a = w.attention_work()
    c = Candidate(_mesh(data=8), 0, remat="none", precision="fp32")
    fused = score(w, optax.adam(1e-3), c, _cluster()).estimate.time["memory"]
    eager = score(w, optax.adam(1e-3), c, _cluster(fused=False)).estimate.time["memory"]
    b = 16 / 8
    act_traffic = 2 * w.activation_bytes_per_example * b
    assert eager - fused == pytest.approx((3 * a.elementwise_bytes * b - act_traffic) / H100.memory_bandwidth)
    scores = score(w, optax.adam(1e-3), c, _cluster(flash_attention=False, score_bytes=30.0)).estimate.time
    assert scores["memory"] - fused == pytest.approx(a.score_elements * b * 30.0 / H100.memory_bandwidth)
    again = score(
        w,
        optax.adam(1e-3),
        dataclasses.replace(c, remat="full"),
        _cluster(flash_attention=False, score_bytes=30.0, score_bytes_forward=13.0),
    ).estimate.time["memory"]
    base = score(w, optax.adam(1e-3), dataclasses.replace(c, remat="full"), _cluster()).estimate.time["memory"]
    assert again - base == pytest.approx(a.score_elements * b * 43.0 / H100.memory_bandwidth)  # recomputed


def test_a_flash_kernel_skips_the_causal_half_at_its_own_rate():
    w = _gpt()
    a = w.attention_work()
    c = Candidate(_mesh(data=8), 0, remat="none", precision="fp32")
    t = score(w, optax.adam(1e-3), c, _cluster(causal_skip=True, attention_efficiency=0.3)).estimate.time
    flops = w.flops_per_example * 2
    projections = flops * (1 - a.attention_share) / (H100.peak_flops * matmul_efficiency(w, H100, 2, 1, 0, False))
    attention = flops * a.attention_share * 0.5 / (H100.peak_flops * 0.3)
    assert t["compute"] == pytest.approx(projections + attention)


def test_interleaving_divides_the_pipeline_bubble():
    cfg = dataclasses.replace(CFG, n_layers=8)
    w = _gpt(cfg)
    c = Candidate(_mesh(stage=4, data=2), 0, microbatches=8)
    for v in (1, 2):
        t = score(w, optax.adam(1e-3), dataclasses.replace(c, virtual=v), Cluster(H100, 1, 8)).estimate.time
        busy = t["compute"] + t["memory"] + t["offload"]
        assert t["bubble"] == pytest.approx(busy * 3 / (v * 8))


def test_stacks_are_named_cited_and_checked():
    assert stack("megatron-2021") is STACKS["megatron-2021"] and all(s.sources for s in STACKS.values())
    with pytest.raises(PlanningError, match="unknown software stack 'nope'"):
        stack("nope")
    with pytest.raises(PlanningError, match="moves no scores"):
        Stack("x", flash_attention=True, score_bytes=4.0)
    with pytest.raises(PlanningError, match="attention_efficiency"):
        Stack("x", attention_efficiency=1.5)
    assert Cluster(H100).stack.name == "openhosti"  # the default: this library's


def test_a_pipeline_splits_tensors_only_where_the_stack_does():
    """This library's pipeline stages split their layers over tensor (tests/test_pipeline_tensor.py), as
    Megatron-Core's do: a pipelined mesh with a tensor axis is priced, sequence parallel, on both stacks, and
    refused on a stack whose stages split only the batch. The planner offers such meshes for this library."""
    init = lambda r: GPT(CFG, rngs=nnx.Rngs(r))  # noqa: E731
    mesh = "stage=2,fsdp=2,tensor=2"
    for name in ("openhosti", "megatron-core"):
        p = predict(init, optax.adam(1e-3), BATCH, Cluster(H100, 1, 8, STACKS[name]), mesh=mesh, microbatches=4)
        assert p.plan.sequence_parallel and p.plan.pipeline_stages == 2 and p.plan.mesh_shape["tensor"] == 2
    batch_only = dataclasses.replace(STACKS["openhosti"], name="batch-only", pipeline_tensor=False)
    with pytest.raises(PlanningError, match="pipeline_tensor"):
        predict(init, optax.adam(1e-3), BATCH, Cluster(H100, 1, 8, batch_only), mesh=mesh, microbatches=4)
    own = enumerate_candidates(64, pipeline=True, pipeline_tensor=STACKS["openhosti"].pipeline_tensor)
    assert [c for c in own if c.mesh_shape["stage"] > 1 and c.mesh_shape["tensor"] > 1]


def test_gpt3_pipelines_over_tensor_on_this_librarys_stack():
    """GPT-3 175B on 64 H100 at Megatron's 8 stages x 8-way tensor parallelism: priced on this library's stack,
    not refused, the plan splitting each stage over tensor=8."""
    m = model_preset("gpt3-175b")
    batch = jax.ShapeDtypeStruct((1536, 2048), jnp.int32)
    p = predict(m.init, optax.adamw(1e-4), batch, "64xH100", mesh="stage=8,tensor=8", microbatches=16)
    assert p.plan.pipeline_stages == 8 and p.plan.mesh_shape["tensor"] == 8 and p.cluster.stack.name == "openhosti"
    assert "stage=8 tensor=8" in str(p)
    # each device holds 1/64 of the state, fp32 parameters (bf16 computes on them) and Adam's two moments, but for
    # the norms and biases each tensor rank keeps whole (0.13% more)
    assert 1 < p.memory["state"] / (12 * m.config.num_params() / 64) < 1.002


def test_cudnn_attention_is_priced_at_its_measured_forward_and_backward_rates():
    """Megatron-Core and MaxText on GPU run Transformer Engine's cuDNN attention: a step's attention takes the
    forward's FLOPs at 518 TFLOP/s and the backward's 2.5x at 499 (FlashAttention-3's H100 figures)."""
    forward = 1e15
    seconds = forward / 518e12 + 2.5 * forward / 499e12
    for name in ("megatron-core", "maxtext-gpu"):
        assert 3.5 * forward / (989e12 * STACKS[name].attention_efficiency) == pytest.approx(seconds)


def test_a_compilers_rematerialisation_recomputes_the_overflow_toward_full_recomputation():
    """XLA's rematerialization pass (MaxText on TPU): a plan over the device's memory recomputes the overflow, that
    share of the way from its policy to full recomputation in bytes and in compute; off, the overflow stays."""
    w = _gpt(batch=jax.ShapeDtypeStruct((256, 128), jnp.int32))
    c = Candidate(_mesh(data=8), 0, remat="dots", precision="bf16")

    def est(remat: str, memory: int | None, compiler_remat: bool):
        profile = dataclasses.replace(H100, memory_bytes=memory)
        where = Cluster(profile, 1, 8, dataclasses.replace(STACKS["openhosti"], compiler_remat=compiler_remat))
        return score(w, optax.adam(1e-3), dataclasses.replace(c, remat=remat), where).estimate

    dots, full = est("dots", None, False), est("full", None, False)
    budget = int((dots.bytes + full.bytes) / 2)
    assert est("dots", budget, False).bytes == dots.bytes > budget  # no compiler remat: it would not fit
    squeezed = est("dots", budget, True)
    share = (dots.bytes - budget) / (dots.bytes - full.bytes)
    assert squeezed.bytes == pytest.approx(budget, abs=1)
    compute = dots.time["compute"] + share * (full.time["compute"] - dots.time["compute"])
    assert squeezed.time["compute"] == pytest.approx(compute)
    assert est("dots", 2 * dots.bytes, True).time == dots.time  # room to spare: nothing recomputed


def test_a_plan_that_fits_only_by_the_compilers_rematerialisation_is_searched_with_each_remat_policy():
    """Squeezed by the compiler, ``remat=none`` hides more recomputation than ``dots``, which fits as it is: the
    search scores the policies too, and ranks by the recomputation the step runs, not by the policy's name."""
    w = _gpt(batch=jax.ShapeDtypeStruct((256, 128), jnp.int32))
    c = Candidate(_mesh(data=8), 0, precision="bf16")
    free = _cluster(compiler_remat=True)
    none, dots = (score(w, optax.adam(1e-3), dataclasses.replace(c, remat=r), free).estimate for r in ("none", "dots"))
    budget = int((none.bytes + dots.bytes) / 2)
    where = dataclasses.replace(free, profile=dataclasses.replace(H100, memory_bytes=budget))
    scored = search(w, optax.adam(1e-3), [c], where, memory_budget=budget, remats=("none", "dots", "full"))
    by_remat = {s.candidate.remat: s.estimate for s in scored}
    assert by_remat["none"].bytes == pytest.approx(budget, abs=1)  # it fits, by the compiler's recomputation
    assert (
        by_remat["none"].flops_factor
        > by_remat["dots"].flops_factor
        == w.policy_activations("dots", "bf16").flops_factor
    )
    assert rank(scored, budget)[0].candidate.remat == "dots"


def test_the_own_stack_prices_cudnn_attention_only_where_it_runs():
    """cuDNN's fused attention (its H100 rate, the causal half skipped) on Hopper in half precision; an fp32 step
    or another device runs XLA's, priced as plain fused ops."""
    w = _gpt()
    own = STACKS["openhosti"]
    plain = dataclasses.replace(own, causal_skip=False, attention_efficiency=None)

    def compute(software, profile, precision):
        c = Candidate(_mesh(data=8), 0, remat="none", precision=precision)
        return score(w, optax.adam(1e-3), c, Cluster(profile, 1, 8, software)).estimate.time["compute"]

    assert compute(own, H100, "bf16") != compute(plain, H100, "bf16")
    assert compute(own, H100, "fp32") == compute(plain, H100, "fp32")
    assert compute(own, PROFILES["A100"], "bf16") == compute(plain, PROFILES["A100"], "bf16")


def test_the_own_stack_prices_the_splash_kernel_on_every_tpu():
    """On a TPU the library's attention is the Pallas splash kernel in bf16 and fp32 alike (tests/test_models_splash.py
    reads it from the program lowered for a v5p mesh): attention's masked half skipped at the device's matmul rate,
    no scores in memory, the H100 cuDNN rate not applied; switched off, the same step is priced as XLA's blocks. The
    kernel's own block mask skips what the price skips: causal at 8192 tokens in blocks of 512 it computes
    (n + 1) / 2n of the n x n blocks (n = 16), the half the price assumes and the diagonal."""
    from openhosti_jax.models.splash import causal_block_fraction

    w = _gpt()
    a = w.attention_work()
    own = STACKS["openhosti"]
    assert set(own.splash_on) == {k for k in PROFILES if k.startswith("TPU")}
    v5p = PROFILES["TPU v5p"]
    flops = w.flops_per_example * 2  # 16 examples over data=8
    eff = functools.partial(matmul_efficiency, w, v5p, 2, 1, 0)
    for precision in ("bf16", "fp32"):
        c = Candidate(_mesh(data=8), 0, remat="none", precision=precision)
        t = score(w, optax.adam(1e-3), c, Cluster(v5p, 1, 8, own)).estimate.time
        xla = score(w, optax.adam(1e-3), c, Cluster(v5p, 1, 8, dataclasses.replace(own, splash_on=()))).estimate.time
        projections = flops * (1 - a.attention_share) / (v5p.peak_flops * eff(False))
        attention = flops * a.attention_share * 0.5 / (v5p.peak_flops * eff(True))
        assert t["compute"] == pytest.approx(projections + attention)
        assert xla["compute"] == pytest.approx(flops / (v5p.peak_flops * eff(None)))
        assert t["memory"] == xla["memory"] and t["compute"] < xla["compute"]
    assert causal_block_fraction(8192) == 17 / 32 and causal_block_fraction(1024) == 3 / 4  # 16 and 2 blocks
