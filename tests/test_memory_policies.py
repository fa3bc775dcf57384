"""Remat and mixed precision change no result beyond their own rounding, apply to users' models without a change to
their code, and are planner dimensions: a budget that the plain plan exceeds gets a remat policy that compiles
within it, and a plan that fits gets none."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import openhosti_jax as oh
from openhosti_jax.demo.examples import gpt_step
from openhosti_jax.errors import PlanningError, StateError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.models.gpt import GPT, GPTConfig, next_token_loss
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.planner import PROFILES, choose_plan
from openhosti_jax.planner.profiles import XLA_CPU
from openhosti_jax.planner.search import Candidate, score
from openhosti_jax.planner.verify import compiled_step_bytes
from openhosti_jax.planner.workload import remat_blocks, workload
from openhosti_jax.policies.optimizers import MasterWeightsState
from openhosti_jax.policies.precision import PRECISIONS, state_bytes_per_param
from openhosti_jax.policies.remat import available_remat
from openhosti_jax.state.blocks import linen_block_paths, nnx_blocks
from openhosti_jax.state.context import active_policies
from openhosti_jax.state.model import model_parts

TOKENS = jax.random.randint(jax.random.key(1), (8, 32), 0, 256)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32)(jnp.tanh(nn.Dense(64)(nn.LayerNorm()(x))))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = LinenBlock()(x)
        return nn.Dense(4)(x)


def _models():
    x = jax.random.normal(jax.random.key(2), (8, 32))
    return {
        "nnx-list": (lambda r: GPT(GPTConfig.tiny(n_layers=3), rngs=nnx.Rngs(r)), TOKENS),
        "nnx-scan": (lambda r: GPT(GPTConfig.tiny(n_layers=3, scan_layers=True), rngs=nnx.Rngs(r)), TOKENS),
        "llama-scan": (lambda r: Llama(LlamaConfig.tiny(n_layers=3, scan_layers=True), rngs=nnx.Rngs(r)), TOKENS),
        "linen": (LinenNet(), x),
        "function": (
            lambda r: {"w": jax.random.normal(r, (32, 32)), "v": jax.random.normal(r, (32, 4))},
            x,
        ),
    }


def _function_apply(p, x, model_state=None):
    return jnp.tanh(x @ p["w"]) @ p["v"]


def _loss_and_grads(kind, remat, precision="fp32"):
    model, batch = _models()[kind]
    parts = model_parts(model, batch, apply_fn=_function_apply if kind == "function" else None)
    params, state = parts.init(jax.random.key(0))

    def loss(p):
        out = parts.apply_fn(p, batch, model_state=state)
        if out.ndim == 3:
            total, count = next_token_loss(out, batch)
            return total / count
        return jnp.mean(out**2)

    with active_policies(remat, precision) as used:
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        blocks = remat_blocks(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    assert used.applied
    return float(value), grads, blocks


@pytest.mark.slow  # 46 s on the 2-core machine: too long for the fast suite
@pytest.mark.parametrize("kind", ["nnx-list", "nnx-scan", "llama-scan", "linen", "function"])
@pytest.mark.parametrize("remat", ["dots", "selective", "full"])
@pytest.mark.timeout(120)
def test_remat_changes_no_result_and_needs_no_model_change(kind, remat):
    ref_loss, ref_grads, ref_blocks = _loss_and_grads(kind, "none")
    loss, grads, blocks = _loss_and_grads(kind, remat)
    assert ref_blocks == 0 and blocks > 0  # the policy really checkpoints the blocks (not only the activations)
    assert abs(loss - ref_loss) <= 1e-6
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)


def test_blocks_are_found_in_lists_scans_and_linen_siblings():
    assert len(nnx_blocks(GPT(GPTConfig.tiny(n_layers=3), rngs=nnx.Rngs(0)))) == 3
    assert [p for p, _ in nnx_blocks(GPT(GPTConfig.tiny(n_layers=3, scan_layers=True), rngs=nnx.Rngs(0)))] == [
        ("blocks",)
    ]
    parts = model_parts(LinenNet(), jnp.zeros((2, 32)))
    assert linen_block_paths(parts.params) == {("LinenBlock_0",), ("LinenBlock_1",), ("LinenBlock_2",)}


@pytest.mark.slow  # 6 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_bf16_compute_stays_within_the_derived_bound():
    """bfloat16 keeps 8 significant bits: each rounding to it is off by at most u = 2^-9 relative. On the loss's
    longest path the 3-layer GPT rounds its values D times: the embeddings once, per block the two norms and five
    matmul inputs and the two residual sums (9), and the final norm and head twice, so D = 1 + 9 x 3 + 2 = 30. To first
    order the loss is then off by at most D * u relative, a worst case that assumes every rounding error adds in
    the same direction (about 6%); the gradients' relative norm error gets twice that (the backward rounds as
    often again)."""
    d, u = 1 + 9 * 3 + 2, 2.0**-9
    ref_loss, ref_grads, _ = _loss_and_grads("nnx-list", "none")
    loss, grads, _ = _loss_and_grads("nnx-list", "none", "bf16")
    assert loss != ref_loss  # it really computed in bfloat16
    assert abs(loss - ref_loss) <= d * u * abs(ref_loss)
    g, r = (jnp.concatenate([x.ravel().astype(jnp.float32) for x in jax.tree.leaves(t)]) for t in (grads, ref_grads))
    assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) <= 2 * d * u


def _gpt_step(state, tokens):
    def loss(p):
        total, count = next_token_loss(state.apply_fn(p, tokens, model_state=state.model_state), tokens)
        return total / count

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


@pytest.mark.slow  # 36 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scan", [False, True])
def test_a_remat_plan_trains_to_the_same_losses(scan):
    """Three Adam steps under ZeRO-3 on 8 devices, the plan's remat full against none."""
    mesh = oh.build_mesh(oh.MeshConfig(fsdp=8))
    init = lambda r: GPT(GPTConfig.tiny(n_layers=3, scan_layers=scan), rngs=nnx.Rngs(r))
    losses = {}
    for remat in ("none", "full"):
        state, plan = oh.create_train_state(init, optax.adam(1e-2), mesh, plan="fsdp", remat=remat)
        assert plan.remat == remat and f"remat           {remat}" in plan.table()
        step = oh.spmd(_gpt_step, mesh=mesh, plan=plan)
        losses[remat] = []
        for _ in range(3):
            state, metrics = step(state, TOKENS)
            losses[remat].append(float(metrics["loss"]))
    # within 1e-6 relative: about two float32 ulps of a loss near 5 (XLA may fuse the recomputed forward differently)
    np.testing.assert_allclose(losses["full"], losses["none"], rtol=1e-6, atol=0)


def test_a_policy_the_step_cannot_apply_is_refused():
    mesh = oh.build_mesh(oh.MeshConfig(data=8))
    state, plan = oh.create_train_state(
        lambda r: {"w": jnp.ones((4, 1))}, optax.sgd(0.1), mesh, plan="dp", remat="full"
    )

    @oh.spmd(mesh=mesh, plan=plan)
    def step(state, batch):  # never calls state.apply_fn: remat cannot reach the model
        grads = jax.grad(lambda p: jnp.sum(batch @ p["w"]))(state.params)
        return state.apply_gradients(grads=grads), {}

    with pytest.raises(StateError, match="never called one"):
        step(state, jnp.ones((8, 4)))
    with pytest.raises(PlanningError, match="not available on cpu"):
        choose_plan(lambda r: {"w": jnp.ones((4, 1))}, optax.sgd(0.1), jnp.ones((8, 4)), remat="offload")
    assert "offload" not in available_remat(jax.devices())


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_params_state_bytes_match_the_formula(stage):
    """bf16 parameters, an fp32 master copy and fp32 Adam moments: 2 + 4 + 8 bytes per parameter per replica, the
    master and moments (stage >= 1) and the parameters (stage 3) divided over the 8 devices."""
    mesh = oh.build_mesh(oh.MeshConfig(fsdp=8) if stage else oh.MeshConfig(data=8))
    cfg = GPTConfig(n_layers=2, d_model=128, seq_len=32)
    state, plan = oh.create_train_state(
        lambda r: GPT(cfg, rngs=nnx.Rngs(r)), optax.adam(1e-3), mesh, plan=stage, precision="bf16_params"
    )
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert isinstance(state.opt_state, MasterWeightsState)
    device = jax.devices()[0]
    held = sum(
        s.data.nbytes
        for x in jax.tree.leaves((state.params, state.opt_state))
        for s in x.addressable_shards
        if s.device == device
    )
    formula = cfg.num_params() * state_bytes_per_param(PRECISIONS["bf16_params"], stage, 8)
    assert 0.9 <= held / formula <= 1.1, (held, formula)


@pytest.mark.timeout(300)
def test_fp16_loss_scaling_skips_a_non_finite_step_and_reports_it():
    mesh = oh.build_mesh(oh.MeshConfig(data=8))

    def loss_sum_fn(p, batch, rng):
        out = state.apply_fn({"params": p}, batch["x"])
        return jnp.sum((out - batch["y"]) ** 2), batch["x"].shape[0]

    model = nn.Dense(1)
    x = jax.random.normal(jax.random.key(0), (8, 4))
    state, plan = oh.create_train_state(
        lambda r: model.init(r, x)["params"], optax.adam(1e-2), mesh, plan="dp", apply_fn=model.apply, precision="fp16"
    )
    step = oh.spmd(oh.make_train_step(loss_sum_fn), mesh=mesh, plan=plan)
    good = {"x": x, "y": jnp.ones((8, 1))}
    scale, skipped = 2.0**15, 0
    for _ in range(8):  # the initial scale overflows float16 here: each skipped step halves it, as in GradScaler
        state, m = step(state, good)
        assert float(m["loss_scale"]) == scale  # the scale this step used
        if int(m["skipped_steps"]) == skipped:
            break
        skipped, scale = skipped + 1, scale / 2
    assert int(m["skipped_steps"]) == skipped and np.isfinite(float(m["loss"]))
    before = jax.device_get(state.params)
    state, m = step(state, {"x": x.at[0, 0].set(jnp.inf), "y": good["y"]})
    assert int(m["skipped_steps"]) == skipped + 1 and float(m["loss_scale"]) == scale
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)  # the non-finite step changed nothing
    state, m = step(state, good)
    assert int(m["skipped_steps"]) == skipped + 1 and float(m["loss_scale"]) == scale / 2


def _scanned_gpt():
    cfg = GPTConfig(n_layers=6, d_model=64, n_heads=4, seq_len=64, scan_layers=True)
    return (lambda r: GPT(cfg, rngs=nnx.Rngs(r))), jax.ShapeDtypeStruct((32, 64), jnp.int32)


@pytest.mark.slow  # 16 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_the_planner_picks_remat_only_when_the_plain_plan_does_not_fit():
    init, batch = _scanned_gpt()
    tx = optax.adam(1e-3)
    plan, report = choose_plan(init, tx, batch, step_fn=_gpt_step, device_profile="H100", memory_budget=2**40)
    assert plan.remat == "none" and report.compiled_bytes is not None
    budget = int(report.compiled_bytes * 0.6)
    plan, report = choose_plan(init, tx, batch, step_fn=_gpt_step, device_profile="H100", memory_budget=budget)
    assert plan.remat != "none", report.notes
    assert report.compiled_bytes <= budget  # verified by the compiler, not only predicted
    assert any("without them" in n for n in report.notes), report.notes


@pytest.mark.slow  # 38 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_a_step_that_accumulates_gets_remat_and_microbatches_chosen_together_and_trains_the_same():
    """With a step that reads the microbatch count, the search under a tight budget may also split the batch; the
    plan it returns compiles within the budget and trains to the losses of the unconstrained plan."""
    init, batch = _scanned_gpt()
    apply = model_parts(init).apply_fn

    def loss_sum_fn(p, tokens, rng):
        return next_token_loss(apply(p, tokens), tokens)

    step_fn = oh.make_train_step(loss_sum_fn)
    tx = optax.adam(1e-3)
    free, free_report = choose_plan(init, tx, batch, step_fn=step_fn, device_profile="H100", memory_budget=2**40)
    budget = int(free_report.compiled_bytes * 0.6)
    tight, report = choose_plan(init, tx, batch, step_fn=step_fn, device_profile="H100", memory_budget=budget)
    assert (tight.remat, tight.num_microbatches) != ("none", 1) and report.compiled_bytes <= budget
    tokens = jax.random.randint(jax.random.key(3), batch.shape, 0, 256)
    losses = {}
    for name, plan in (("free", free), ("tight", tight)):
        mesh = oh.build_mesh(oh.MeshConfig.from_sizes(dict(plan.mesh_shape)))
        state, _ = oh.create_train_state(init, tx, mesh, plan=plan)
        step = oh.spmd(step_fn, mesh=mesh, plan=plan)
        losses[name] = []
        for _ in range(2):
            state, metrics = step(state, tokens)
            losses[name].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["tight"], losses["free"], rtol=1e-5)


@pytest.mark.timeout(300)
def test_selective_remat_keeps_every_other_projection_and_prices_its_recompute():
    """Remat "selective" on Llama keeps q, v, the attention output, the gate and the down projection (torchtitan's
    op-level selective checkpointing): less than "dots" and more than "full"; its extra FLOPs are the projections
    it does not keep (k, o, up) run again, counted from the trace; the compiled step's memory is within 10% of the
    prediction on 8 CPU devices."""
    d, kv, ffn, s, layers = 128, 32, 384, 64, 3
    cfg = LlamaConfig(
        vocab_size=256, seq_len=s, d_model=d, n_layers=layers, n_heads=8, n_kv_heads=2, ffn=ffn, scan_layers=True
    )
    init = lambda r: Llama(cfg, rngs=nnx.Rngs(r))  # noqa: E731
    work = workload(init, jax.ShapeDtypeStruct((16, s), jnp.int32))
    kept = {r: work.policy_activations(r, "fp32") for r in ("dots", "selective", "full")}
    assert kept["full"].bytes_per_example < kept["selective"].bytes_per_example < kept["dots"].bytes_per_example
    unkept = 2 * s * layers * (d * kv + d * d + d * ffn)  # k, o and up, forward, per example
    assert kept["selective"].flops_factor == pytest.approx(1.1 + unkept / work.flops_per_example)
    tx = optax.adam(1e-3)
    cpu = dataclasses.replace(
        PROFILES["H100"], native_reduce_scatter=False, memory=XLA_CPU
    )  # CPU all-reduces, as in test_planner_memory
    sc = score(work, tx, Candidate({"stage": 1, "data": 8, "fsdp": 1, "tensor": 1}, 0, remat="selective"), cpu)
    mesh = build_mesh(MeshConfig.from_sizes(dict(sc.plan.mesh_shape)))
    compiled = compiled_step_bytes(sc.plan, work, tx, gpt_step, mesh)
    assert 0.9 < sc.estimate.bytes / compiled < 1.1, (sc.estimate.memory, compiled)
