"""A mixture-of-experts Llama through the pipeline: each block's aux (load-balancing and z-loss, expert counts)
carried to the loss, its experts run expert-parallel inside a stage (batch over data / fsdp x expert, tokens
exchanged by all-to-alls), both dispatch modes, against one device running the same microbatches; the planner
offering and pricing stage x expert meshes.

The reference, independent of the pipeline code: with ``R`` token shards (``data x fsdp x expert``, rows split in
that order) and ``M`` microbatches, device ``r`` holds rows ``[r B/R, (r+1) B/R)`` and its microbatch ``m`` is the
``m``-th ``B/(R M)`` of them; global microbatch ``m`` is every device's microbatch ``m``, devices in order. One MoE
call routes one global microbatch (capacity and aux statistics are per call), so the reference is a plain
``jax.grad`` of ``next_token_loss + moe_loss(aux)`` of ``model(x_m, with_aux=True)`` on one device, for each
``x_m``, the losses and gradients averaged over ``m``.

Collective runs happen in subprocesses with timeouts (a half-entered collective would hang the test process).
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import openhosti_jax as oh
from openhosti_jax.checkpoint import CheckpointManager
from openhosti_jax.errors import PipelineError, ShardingError, StateError
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.models.moe import MoEAux, MoEBlock, MoEConfig, moe_layer
from openhosti_jax.pipeline import LayerCost, evaluate_partition, gpipe, init_pipeline_state
from openhosti_jax.pipeline.split import split_layers
from openhosti_jax.planner.cluster import cluster
from openhosti_jax.planner.cost import estimate
from openhosti_jax.planner.search import enumerate_candidates, expert_sizes, score
from openhosti_jax.planner.stacks import STACKS
from openhosti_jax.planner.workload import workload
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sizes import tree_bytes
from openhosti_jax.state.context import active_token_axes
from openhosti_jax.state.init import abstract_train_state

TOL = 1e-5
PARAM_TOL = 1e-4
"""Parameters after 3 Adam steps, absolute (relative 1e-5 as `TOL`): Adam divides each gradient by its running
magnitude, so an element whose gradient is a near-cancelling sum carries the summation order's rounding into its
step at a relative size the gradients never show (gradients agree within 1e-7 here; tests/test_expert_parallel.py
allows 5e-5 unpipelined, and the pipeline sums each gradient over microbatches and stages in another order)."""

SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import openhosti_jax as oh
from openhosti_jax.models.gpt import next_token_loss
from openhosti_jax.models.llama import Llama, LlamaConfig, moe_loss
from openhosti_jax.pipeline import make_pipeline_step
from openhosti_jax.train import from_model_state, to_model_state

args = json.loads(sys.argv[1])
sizes, M, B = args["mesh"], args["microbatches"], args["batch"]
kw = dict(n_layers=args["layers"], num_experts=4, top_k=2, moe_ffn=64, router_z_loss_weight=1e-3,
          capacity_factor=None if args["dispatch"] == "dropless" else 1.0)
if args["scan"]:  # a dense first layer, then the MoE ones as one scanned stack with a shared expert
    kw.update(first_dense_layers=1, shared_experts=1, scan_layers=True)
cfg = LlamaConfig.tiny(**kw)
init = lambda r: Llama(cfg, rngs=nnx.Rngs(r))
toks = [jax.random.randint(jax.random.key(s), (B, 16), 0, 256) for s in (2, 3, 2)][: args["steps"] or 1]
mesh = oh.build_mesh(oh.MeshConfig(**sizes))
plan = oh.ShardingPlan.from_zero({}, None, dict(mesh.shape), args.get("zero", 0), pipeline_stages=sizes["stage"],
                                 num_microbatches=M)
tx = optax.adam(1e-2, eps=1e-5)
state, _ = oh.create_train_state(init, tx, mesh, plan=plan, sample_batch=toks[0], model_kwargs={"with_aux": True})
params, opt = to_model_state(state)
# routers 25x the init's scale: no two experts nearly tie for a token, so rounding cannot flip a routing decision
params = jax.tree_util.tree_map_with_path(
    lambda p, x: x * 25 if "router" in jax.tree_util.keystr(p) else x, jax.device_get(params))
state = from_model_state(params, opt, state, mesh)

def mean_loss(outputs, tokens):  # what the unpipelined moe_step adds: the LM loss and moe_loss(aux)
    logits, aux = outputs
    total, count = next_token_loss(logits, tokens)
    return total / count + moe_loss(aux)

R = int(np.prod([mesh.shape[a] for a in ("data", "fsdp", "expert")]))
graphdef = nnx.graphdef(init(0))
one = jax.devices()[0]

def micro(tok):  # global microbatch m: every token shard's m-th local microbatch, shards in order
    return tok.reshape(R, M, B // (R * M), -1).transpose(1, 0, 2, 3).reshape(M, B // M, -1)

def ref_loss(p, tok):
    logits, aux = nnx.merge(graphdef, p)(tok, with_aux=True)
    total, count = next_token_loss(logits, tok)
    return total / count + moe_loss(aux), aux

@jax.jit
def ref_value_and_grad(p, tok):
    outs = [jax.value_and_grad(ref_loss, has_aux=True)(p, x) for x in micro(tok)]
    loss = sum(o[0][0] for o in outs) / M
    return loss, jax.tree.map(lambda *g: sum(g) / M, *[o[1] for o in outs]), [o[0][1] for o in outs]

def errors(a, b):
    pairs = zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True)
    return [float(np.max(np.abs(np.asarray(x) - np.asarray(y)) / (1 + np.abs(np.asarray(y))))) for x, y in pairs]

seq = state.sequence
grad_step = make_pipeline_step(seq.layers, mean_loss, mesh, state.partition, state.schedule)
loss, grads = grad_step(seq.split(params), (toks[0], toks[0]))
p1 = jax.device_put(params, one)
ref, ref_grads, auxes = jax.device_get(ref_value_and_grad(p1, jax.device_put(toks[0], one)))
out = {"loss": float(loss), "ref_loss": float(ref), "grad_err": max(errors(seq.merge(grads), ref_grads)),
       "grad_max": max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads)),
       "dropped": [float(a.dropped_fraction.mean()) for a in auxes],
       "aux_loss": [float(a.loss.sum()) for a in auxes], "stages": list(state.partition.boundaries),
       "expert_slots": state.packing.expert, "spec": str(state.params.sharding.spec)}
if args["steps"]:
    step = oh.pipeline_step(mean_loss, mesh, state)
    result = oh.Trainer(step, progress=False).fit(state, iter([(t, t) for t in toks]), len(toks))

    @jax.jit
    def ref_step(p, o, tok):
        loss, g, _ = ref_value_and_grad(p, tok)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    p, o, ref_losses = p1, tx.init(p1), []
    for t in toks:
        p, o, l = ref_step(p, o, jax.device_put(t, one))
        ref_losses.append(float(l))
    out.update(losses=[float(r["loss"]) for r in result.history], ref_losses=ref_losses,
               param_err=max(errors(to_model_state(result.state)[0], p)))
print(json.dumps(out))
"""


def run(tmp_path, timeout: int, **args) -> dict:
    path = tmp_path / "pipeline_moe.py"
    path.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(path), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=os.getcwd(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(out: dict, dispatch: str, mesh: dict, zero: int = 0) -> None:
    # each expert rank holds only its experts (and over fsdp, ZeRO-3 shards each expert slot further)
    assert out["expert_slots"] == mesh["expert"], out
    inner = ("expert", *[a for a, on in (("tensor", True), ("fsdp", zero == 3)) if on and mesh.get(a, 1) > 1])
    assert out["spec"] == str(P(None, "stage", inner if len(inner) > 1 else inner[0])), out
    assert abs(out["loss"] - out["ref_loss"]) <= TOL * abs(out["ref_loss"]), out
    assert out["grad_err"] <= TOL * out["grad_max"], out
    dropped = max(out["dropped"])
    assert dropped > 0 if dispatch == "capacity" else dropped == 0, out  # capacity per global microbatch
    if "losses" in out:
        for got, want in zip(out["losses"], out["ref_losses"], strict=True):
            assert abs(got - want) <= TOL * abs(want), out
        assert out["param_err"] <= PARAM_TOL, out
        assert out["ref_losses"][-1] < out["ref_losses"][0]  # it trained


MESHES = {
    "stage2-expert2-data2": {"stage": 2, "expert": 2, "data": 2},
    "stage2-expert4": {"stage": 2, "expert": 4},
    "stage2-expert2-fsdp2": {"stage": 2, "expert": 2, "fsdp": 2},
    "stage2-tensor2-expert2": {"stage": 2, "tensor": 2, "expert": 2},
}


@pytest.mark.slow  # a process (the fast suite runs none); ~40 s on the loaded 2-core machine
@pytest.mark.timeout(300)
def test_capacity_moe_gradients_through_stage2_expert2_data2_equal_one_device(tmp_path):
    out = run(tmp_path, 280, mesh=MESHES["stage2-expert2-data2"], dispatch="capacity", microbatches=2, batch=8,
              layers=2, scan=False, steps=0)  # fmt: skip
    check(out, "capacity", MESHES["stage2-expert2-data2"])
    # a block per stage; each microbatch's aux loss (0.01 x balance + 1e-3 x z-loss, over 2 layers) is ~0.4% of
    # the loss, 400 x TOL: a pipeline that dropped it, or computed it per device, would fail the loss check
    assert out["stages"] == [0, 2, 3, 4] or len(out["stages"]) == 3
    assert min(out["aux_loss"]) > 0.02


@pytest.mark.slow  # a process; ~35 s on the loaded 2-core machine
@pytest.mark.timeout(300)
def test_capacity_moe_gradients_through_stage2_tensor2_expert2_equal_one_device(tmp_path):
    """Tensor and expert compose inside a stage: each rank's expert slot holds its experts split over tensor too
    (hidden widths, Megatron style), XLA partitions them over tensor and the tokens travel over expert."""
    mesh = MESHES["stage2-tensor2-expert2"]
    out = run(tmp_path, 280, mesh=mesh, dispatch="capacity", microbatches=2, batch=8, layers=2, scan=False, steps=0)
    check(out, "capacity", mesh)


ADAM_CASES = [  # the data, expert and fsdp meshes, both dispatch modes, both layouts (each case 65-96 s in CI)
    ("stage2-expert2-data2", False, "dropless", 0),
    ("stage2-expert4", True, "capacity", 0),
    ("stage2-expert2-fsdp2", True, "dropless", 3),  # ZeRO-3 over fsdp on top of the experts split over expert
]


@pytest.mark.slow  # ~1-2 min each on the loaded 2-core machine
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("mesh_name", "scan", "dispatch", "zero"), ADAM_CASES)
def test_three_adam_steps_through_the_pipeline_equal_one_device(tmp_path, mesh_name, scan, dispatch, zero):
    out = run(tmp_path, 580, mesh=MESHES[mesh_name], dispatch=dispatch, microbatches=2, batch=16, layers=4,
              scan=scan, steps=3, zero=zero)  # fmt: skip
    check(out, dispatch, MESHES[mesh_name], zero)


def _moe_llama(**kw):
    cfg = LlamaConfig.tiny(num_experts=4, top_k=2, **kw)
    return cfg, (lambda r: Llama(cfg, rngs=nnx.Rngs(r)))


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


@pytest.mark.timeout(300)
def test_each_expert_rank_of_a_stage_holds_its_experts_and_their_moments_and_a_checkpoint_restores(tmp_path):
    """stage=2 x expert=4, 4 experts, one MoE block per stage: each device's shard of the packed parameters and
    of Adam's two moments holds the stage's other weights whole and exactly its own expert of each expert weight,
    1/4 of the stage's expert bytes; a checkpoint of the state restores bit for bit onto the same shardings."""
    cfg, init = _moe_llama(n_layers=2, moe_ffn=64)
    mesh = oh.build_mesh(oh.MeshConfig(stage=2, expert=4))
    plan = ShardingPlan.from_zero({}, None, dict(mesh.shape), 0, pipeline_stages=2, num_microbatches=2)
    tok = jnp.zeros((8, 16), jnp.int32)
    state, _ = oh.create_train_state(
        init, optax.adam(1e-3), mesh, plan=plan, sample_batch=tok, model_kwargs={"with_aux": True}
    )
    seq, packing, x_n, e_n = state.sequence, state.packing, 4, cfg.num_experts
    model = nnx.state(init(0), nnx.Param)  # create_train_state's parameters (its default key)
    paths = seq.split_flat([jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(model)[0]],
                           lambda path, j: f"{path}[{j}]")  # fmt: skip
    layers = seq.split(model)
    per_layer = 3 * e_n * cfg.d_model * 64 * 4  # bytes of one MoE block's routed experts (float32)
    assert len(state.partition.stages) == 2 and all(len(r) == 2 for r in state.partition.stages)  # a block each
    # the widest stage's other weights plus a quarter of its experts: what one device holds of a row
    others = [sum(4 * int(np.prod(x.shape)) for i in r for x, p in zip(layers[i], paths[i], strict=True)
                  if not any(w in p for w in EXPERT_WEIGHTS)) for r in state.partition.stages]  # fmt: skip
    assert packing.expert == x_n and 4 * packing.expert_slot == max(o + per_layer // x_n for o in others)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.shape == state.params.shape]
    assert len(moments) == 2  # Adam's mu and nu, packed like the parameters
    seen = set()
    for array in (state.params, *moments):
        assert array.sharding.spec == P(None, "stage", "expert")
        for shard in array.addressable_shards:
            c, x = shard.index[1].start, shard.index[2].start // packing.expert_slot
            data = np.asarray(shard.data).reshape(-1)
            assert shard.data.nbytes == 4 * packing.expert_slot == array.nbytes // 8  # 1/(stages x experts)
            held = 0
            stage = state.partition.stages[c]
            values = [v for i in stage for v in layers[i]]
            for leaf, path, value in zip(packing.leaves[c], [p for i in stage for p in paths[i]], values, strict=True):
                expert = any(w in path for w in EXPERT_WEIGHTS)
                assert (leaf.edim is not None) == expert, path
                part = data[leaf.offset : leaf.offset + leaf.length]
                if expert:
                    held += 4 * leaf.length
                    mine = np.asarray(value)[x * e_n // x_n : (x + 1) * e_n // x_n]  # this rank's expert
                else:
                    mine = np.asarray(value)  # every rank holds the other weights whole
                if array is state.params:
                    np.testing.assert_array_equal(part, mine.ravel())
            assert held == per_layer // x_n  # closed form: 1/expert of the stage's expert bytes
            seen.add((c, x))
    assert seen == {(c, x) for c in range(2) for x in range(x_n)}
    # a checkpoint of the pipelined state restores onto its shardings, bit for bit
    with CheckpointManager(tmp_path / "ckpt", every_minutes=None) as ckpt:
        assert ckpt.maybe_save(1, state, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(abstract_train_state(state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("scan", [False, True])
def test_the_blocks_aux_reaches_the_last_layer_only_when_asked(scan):
    _, init = _moe_llama(n_layers=2, scan_layers=scan)
    tok = jnp.zeros((2, 16), jnp.int32)
    for kwargs in (None, {"with_aux": True}):
        seq = split_layers(init, tok, model_kwargs=kwargs)
        assert len(seq.layers) == 4  # embedding, 2 blocks, head
        h = tok
        for layer, p in zip(seq.layers, seq.params, strict=True):
            h = jax.eval_shape(layer, p, h)
        if kwargs:
            logits, aux = h
            assert isinstance(aux, MoEAux) and logits.shape == (2, 16, 256)
            assert aux.expert_counts.shape == (2, 4) and aux.loss.shape == (2,)  # stacked over the 2 MoE layers
        else:  # the blocks' statistics the call drops are not carried between layers (int counts among them)
            assert h.shape == (2, 16, 256)


def test_a_stage_whose_expert_axis_does_not_divide_the_experts_is_a_typed_error():
    mesh = Mesh(np.array(jax.devices()[:3]), ("expert",))
    cfg = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2)
    w = MoEBlock(cfg, rngs=nnx.Rngs(0)).weights()

    def body(w, x):
        with active_token_axes(("expert",)):  # as a pipeline stage traces its layers
            return moe_layer(cfg, w, x)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("expert")), out_specs=P("expert"))
    with pytest.raises(ShardingError, match=r"size 3, which does not divide num_experts=4.*use a mesh"):
        jax.eval_shape(f, w, jax.ShapeDtypeStruct((6, 4, 8), jnp.float32))
    two = Mesh(np.array(jax.devices()[:2]), ("expert",))
    f = jax.shard_map(body, mesh=two, in_specs=(P(), P("expert")), out_specs=P("expert"))
    odd = {n: v[:3] if n.startswith("w_") else v for n, v in w.items()}  # neither all 4 experts nor a rank's 2
    with pytest.raises(ShardingError, match=r"all num_experts=4 experts or this 'expert' rank's 2.*found"):
        jax.eval_shape(f, odd, jax.ShapeDtypeStruct((4, 4, 8), jnp.float32))


def test_experts_a_pipelined_expert_axis_does_not_divide_are_typed_errors():
    mesh = oh.build_mesh(oh.MeshConfig(stage=2, expert=4))
    plan = ShardingPlan.from_zero({}, None, dict(mesh.shape), 0, pipeline_stages=2, num_microbatches=2)
    cfg = LlamaConfig.tiny(n_layers=2, num_experts=6, top_k=2)
    init = lambda r: Llama(cfg, rngs=nnx.Rngs(r))  # noqa: E731
    with pytest.raises(ShardingError, match=r"w_gate.*6 experts.*do not divide over the 'expert' axis of size 4"):
        oh.create_train_state(init, optax.adam(1e-3), mesh, plan=plan, sample_batch=jnp.zeros((8, 16), jnp.int32))
    cut = evaluate_partition([LayerCost(1, 1, 1, 1, 1, 1)] * 2, (0, 1, 2), 2)
    params = [{"w": jnp.ones((6, 3))}, {"w": jnp.ones((4, 3))}]
    with pytest.raises(PipelineError, match=r"layer 0 leaf \['w'\].*dim 0 of shape \(6, 3\) over expert=4"):
        init_pipeline_state(params, optax.sgd(0.1), mesh, cut, gpipe(2, 2), tensor_specs=[{"w": P("expert")}] * 2)


def test_model_kwargs_on_an_unpipelined_plan_is_a_typed_error():
    mesh = oh.build_mesh(oh.MeshConfig(data=8))
    _, init = _moe_llama()
    with pytest.raises(StateError, match=r"model_kwargs=\{'with_aux': True\} are for a pipelined plan.*expected"):
        oh.create_train_state(init, optax.adam(1e-3), mesh, plan="dp", model_kwargs={"with_aux": True})


def _work(batch=16, seq=32):
    cfg, init = _moe_llama()
    return cfg, workload(init, jax.ShapeDtypeStruct((batch, seq), jnp.int32))


def test_the_planner_offers_stage_x_expert_meshes_where_the_stack_pipelines_experts():
    sizes = expert_sizes(4, 8, 8)
    ours = [c.label for c in enumerate_candidates(8, pipeline=True, expert=sizes, pipeline_expert=True)]
    assert "stage=2 expert=4 zero0" in ours and "stage=2 data=2 expert=2 zero0" in ours
    assert "stage=2 fsdp=2 expert=2 zero3" in ours
    assert not any("stage=2 expert=4 zero1" in x for x in ours)  # a stage's ZeRO is over fsdp alone
    others = [c.label for c in enumerate_candidates(8, pipeline=True, expert=sizes)]
    assert not any("stage=2" in x and "expert" in x for x in others)
    assert STACKS["openhosti"].pipeline_expert and STACKS["megatron-core"].pipeline_expert
    assert not STACKS["torchtitan"].pipeline_expert  # its published runs (2024) are dense


def test_a_stage_x_expert_plan_prices_its_all_to_alls_per_stage_and_its_experts_whole():
    cfg, work = _work()
    tx, where = optax.adam(1e-3), cluster("8xH100")
    c = next(
        c
        for c in enumerate_candidates(8, pipeline=True, expert=(1, 4), pipeline_expert=True)
        if c.label == "stage=2 expert=4 zero0"
    )
    scored = score(work, tx, c, where)
    plan, e = scored.plan, scored.estimate
    s, n, k, itemsize = 2, 4, plan.num_microbatches, 4
    b_local = 16 / n
    # per MoE layer and microbatch: dispatch and combine, forward, backward and the backward's recomputed forward
    # one all-to-all's buffer: a row per assignment for each of the n devices (the dropless exchange's fixed size)
    message = n * b_local / k * 32 * cfg.top_k * cfg.d_model * itemsize
    count = k * 6 * cfg.moe_layers / s  # a stage's layers
    assert e.time["exposed"] == pytest.approx(count * where.collective_seconds("all_to_all", message, plan.mesh_shape,
                                                                                ("expert",)), rel=1e-12)  # fmt: skip
    full = ShardingPlan.from_zero(work.params, tx, plan.mesh_shape, 0, base_specs=plan.param_specs, remat="full",
                                  pipeline_stages=2, num_microbatches=k)  # fmt: skip
    again = estimate(full, work, tx, where)  # remat recomputes the forward once more inside the recompute
    assert again.comm_bytes - e.comm_bytes == pytest.approx(2 * message * k * cfg.moe_layers / s * (n - 1) / n)
    # each expert rank of a stage holds its experts: state = (parameters + Adam's moments) / stages, the routed
    # experts' (3 matrices of d_model x moe_ffn per expert and MoE layer) 1/n of them
    experts = 4 * cfg.moe_layers * 3 * cfg.num_experts * cfg.d_model * cfg.moe_config().d_ff
    assert e.memory["state"] == (3 * (tree_bytes(work.params) - experts + experts / n) + 4) / s  # + Adam's count


@pytest.mark.timeout(300)
def test_predict_a_pipelined_mixtral_over_expert(capsys):
    from openhosti_jax.cli import main

    args = "predict --model mixtral-8x7b --seq 4096 --cluster 64xH100 --global-batch 256 --mesh stage=4,data=2,expert=8"
    args += " --zero 2 --remat none --precision bf16 --microbatch 16"
    assert main(args.split()) == 0
    out = capsys.readouterr().out
    assert "stage=4 data=2 expert=8 zero2 remat=none bf16 microbatches=16" in out
    # each device holds its 8 layers' other weights and 1 of their 8 experts: 1.8B parameters, 20 GiB with Adam
    # (before the pipeline split experts over expert: 11.7B, 282.7 GiB predicted, too much)
    gib = float(re.search(r"memory per device +([0-9.]+) GiB of 80.0 GiB", out).group(1))
    assert 20 < gib < 80 and "(too much)" not in out
