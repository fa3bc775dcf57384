"""The planner's mixture-of-experts pricing against closed forms: the grouped matmul's FLOPs, the token
all-to-alls, the expert imbalance, the grouped GEMM's size, the expert-sharded state, and the search's expert
meshes."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from openhosti_jax.errors import PlanningError
from openhosti_jax.flops import count_flops, ragged_dot_flops
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.models.presets import model_preset
from openhosti_jax.planner.cluster import Cluster, cluster
from openhosti_jax.planner.cost import estimate, expert_all_to_all_bytes, expert_exchange_padding, matmul_efficiency
from openhosti_jax.planner.predict import model_flops_per_example
from openhosti_jax.planner.profiles import PROFILES, all_to_all_seconds
from openhosti_jax.planner.search import enumerate_candidates, expert_count, expert_sizes, search
from openhosti_jax.planner.stacks import STACKS
from openhosti_jax.planner.workload import workload
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sizes import tree_bytes

SEQ, BATCH = 32, 16


def moe_work(**kw):
    cfg = LlamaConfig.tiny(num_experts=4, top_k=2, **kw)
    return cfg, workload(lambda r: Llama(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32))


def test_ragged_dot_flops_forward_and_transposes():
    groups = jnp.array([3, 5], jnp.int32)
    x, w = jnp.ones((8, 4)), jnp.ones((2, 4, 6))

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, groups), x, w)
        return vjp(y)

    eqns = [e for e in jax.make_jaxpr(fwd_bwd)(x, w).jaxpr.eqns if e.primitive.name == "ragged_dot_general"]
    # forward, the rhs's gradient (ragged contraction) and the lhs's: each 2 m k n, m=8 rows, k=4, n=6
    assert [ragged_dot_flops(e) for e in eqns] == [2 * 8 * 4 * 6] * 3
    assert count_flops(jax.make_jaxpr(fwd_bwd)(x, w), matmul_only=True) == 3 * 2 * 8 * 4 * 6


@pytest.mark.parametrize(
    ("kw", "dense_first"),
    [({}, 0), ({"shared_experts": 1, "first_dense_layers": 1, "moe_ffn": 32, "n_layers": 3}, 1)],
)
def test_traced_flops_equal_the_closed_form_over_active_parameters(kw, dense_first):
    cfg, work = moe_work(**kw)
    assert cfg.first_dense_layers == dense_first
    per_token = model_flops_per_example(work) / work.tokens_per_example  # causal attention counted half
    assert per_token == pytest.approx(cfg.flops_per_token(), rel=0.02)
    e = work.experts()
    assert (e.num_experts, e.layers, e.width) == (4, cfg.moe_layers, cfg.d_model)
    assert e.rows_per_example == SEQ * cfg.top_k * cfg.moe_layers
    assert expert_count(work) == 4


def test_capacity_mode_counts_every_slot_and_no_attention():
    _, dropless = moe_work()
    cfg, work = moe_work(capacity_factor=1.25)
    slots = 4 * math.ceil(1.25 * SEQ * 2 / 4)  # experts x capacity, per layer and example
    assert work.experts().rows_per_example == slots * cfg.moe_layers
    # the experts run every slot: their FLOPs grow by slots / (tokens x top_k), the rest stays
    expert_flops = lambda w: w.flops_per_example * w.experts().share
    assert expert_flops(work) == pytest.approx(expert_flops(dropless) * slots / (SEQ * 2))
    assert work.flops_per_example - expert_flops(work) == pytest.approx(
        dropless.flops_per_example - expert_flops(dropless)
    )
    # the experts' matmuls batched over the experts take a weight, so they are not attention's
    assert work.attention_work().score_elements == dropless.attention_work().score_elements


def test_mixtral_traced_flops_equal_the_preset():
    p = model_preset("mixtral-8x7b", n_layers=2, seq_len=128)
    w = workload(p.init, p.sample_batch(1))
    assert w.flops_per_example / w.tokens_per_example == pytest.approx(p.flops_per_token, rel=0.01)
    assert w.experts().share > 0.5  # the experts are most of a Mixtral layer's matmuls


def test_dense_model_has_no_experts():
    _, work = moe_work()
    dense = workload(lambda r: Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((4, SEQ), jnp.int32))
    assert expert_count(dense) == 0 and dense.experts().rows_per_example == 0
    assert not any(g for _, _, g in dense.gemm_table()) and any(g for _, _, g in work.gemm_table())


def plan_for(work, mesh, zero=0, remat="none", **kw):
    return ShardingPlan.from_zero(work.params, optax.adam(1e-3), mesh, zero, remat=remat, **kw)


def test_all_to_all_bytes_of_the_moe_layers_equal_the_closed_form():
    cfg, work = moe_work()
    n, itemsize = 4, 4  # fp32 plan
    b_local = BATCH / 8  # expert=4 x data=2: the batch's rows split 8 ways
    nbytes, count = expert_all_to_all_bytes(work, b_local, itemsize)
    per_layer = b_local * SEQ * cfg.top_k * cfg.d_model * itemsize  # tokens x top_k x d x itemsize
    assert (nbytes, count) == (4 * per_layer * cfg.moe_layers, 4 * cfg.moe_layers)
    # remat recomputes the block's forward, its two all-to-alls with it: two more per layer, (n-1)/n of each sent;
    # this library's dropless exchange sends each device a row per assignment (n times the rows routed), an exact
    # one (Megatron-Core's variable-size all-to-all) the rows routed
    mesh = {"data": 2, "expert": n}
    for stack, padding in (("openhosti", n), ("megatron-core", 1)):
        where = dataclasses.replace(cluster("8xH100"), stack=STACKS[stack])
        kept, again = (estimate(plan_for(work, mesh, remat=r), work, optax.adam(1e-3), where) for r in ("none", "full"))
        assert again.comm_bytes - kept.comm_bytes == pytest.approx(
            2 * per_layer * cfg.moe_layers * (n - 1) / n * padding
        ), stack


def test_a_padded_capacity_exchange_sends_each_expert_a_slot_per_local_token_up_to_the_capacity():
    """expert_parallel's capacity buffers: experts x min(capacity of the call, local tokens) rows per device, which
    is min(token shards, experts / (capacity_factor x top_k)) times the slots the call routes per device."""
    cfg, work = moe_work(capacity_factor=1.25)
    slots_per_token = math.ceil(1.25 * SEQ * 2 / 4) * 4 / SEQ  # the call's slots over its tokens, per layer
    for shards in (1, 2, 8):
        want = min(shards, cfg.num_experts / slots_per_token)
        assert expert_exchange_padding(work, 4, shards, STACKS["openhosti"]) == pytest.approx(max(1.0, want))
    assert expert_exchange_padding(work, 4, 8, STACKS["megatron-core"]) == 1.0


def test_expert_imbalance_scales_the_routed_share_of_the_compute():
    _, work = moe_work()
    plan = plan_for(work, {"data": 2, "expert": 4})
    tx, h100 = optax.adam(1e-3), PROFILES["H100"]
    even, skewed = (estimate(plan, work, tx, h100, expert_imbalance=x).time["compute"] for x in (1.0, 1.3))
    assert skewed / even == pytest.approx(1 + 0.3 * work.experts().share, rel=1e-9)
    flat = plan_for(work, {"data": 8})  # no expert axis: every device runs every expert on its own tokens
    assert estimate(flat, work, tx, h100, expert_imbalance=1.3).time == estimate(flat, work, tx, h100).time
    with pytest.raises(PlanningError, match="expert_imbalance"):
        estimate(plan, work, tx, h100, expert_imbalance=0.5)


def test_grouped_matmuls_run_at_one_experts_size_times_the_expert_axis():
    _, work = moe_work()
    a100 = PROFILES["A100"]
    table = work.gemm_table()
    for n in (1, 4):
        per_peak = sum(s / a100.gemm_efficiency((mnk * (n if g else 1) * 2) ** (1 / 3)) for mnk, s, g in table)
        assert matmul_efficiency(work, a100, 2, 1, 0.0, expert=n) == pytest.approx(1 / per_peak)
    grouped = [mnk for mnk, _, g in table if g]
    # one expert's rows at batch 1: SEQ tokens x top_2 over 4 experts, by d_model 64 and the expert width 128
    assert grouped == [SEQ * 2 / 4 * 64 * 128]


@pytest.mark.parametrize("zero", [0, 3])
def test_state_bytes_of_an_expert_sharded_plan_equal_the_zero_formula(zero):
    _, work = moe_work()
    plan = plan_for(work, {"data": 2, "expert": 4}, zero, min_elements=1)
    got = estimate(plan, work, optax.adam(1e-3), PROFILES["H100"]).memory["state"]
    leaves = jax.tree.leaves(work.params)
    experts = sum(x.size * 4 for x in leaves if x.ndim >= 3 and 4 in x.shape[:2])  # the (layers, experts, ...) ones
    total = tree_bytes(work.params)
    assert experts > 0
    # Adam: parameters, mu and nu (3 x 4 bytes a parameter) and its step count (4 bytes)
    want = 3 * (total - experts + experts / 4) if zero == 0 else 3 * total / 8
    assert got == pytest.approx(want + 4, rel=1e-6)


def test_all_to_all_across_hosts_takes_the_longer_of_the_nic_and_the_host_links():
    h100 = PROFILES["H100"]
    c = Cluster(h100, 2, 8)
    nbytes, mesh = 2**26, {"expert": 16}
    want = max(all_to_all_seconds(h100, nbytes / 2, 8), c.dcn_seconds("all_to_all", nbytes, 2))
    assert c.collective_seconds("all_to_all", nbytes, mesh, ("expert",)) == want
    assert c.dcn_seconds("all_to_all", nbytes, 2) >= nbytes / 2 / h100.dcn_bandwidth  # half leaves the host
    one_host = Cluster(h100, 1, 8).collective_seconds("all_to_all", nbytes, {"expert": 8}, ("expert",))
    assert one_host == all_to_all_seconds(h100, nbytes, 8)


def test_search_offers_expert_meshes_that_divide_the_experts():
    assert expert_sizes(8, 64, 8) == (1, 2, 4, 8) and expert_sizes(0, 64, 8) == (1,)
    assert expert_sizes(6, 16, 8) == (1, 2)
    labels = [c.label for c in enumerate_candidates(8, expert=expert_sizes(4, 8, 8))]
    assert "data=2 expert=4 zero0" in labels and "expert=4 tensor=2 zero3 sequence-parallel" in labels
    assert "fsdp=2 expert=4 zero3" in labels and not any("expert=8" in x for x in labels)
    assert [c.label for c in enumerate_candidates(2)] == [c.label for c in enumerate_candidates(2, expert=(1,))]
    _, work = moe_work()
    tx = optax.adam(1e-3)
    scored = search(work, tx, enumerate_candidates(8, expert=expert_sizes(4, 8, 8)), cluster("8xH100"))
    by = {s.candidate.label: s for s in scored}
    ep = by["data=2 expert=4 zero0"]
    assert ep.plan.data_parallel_size == 8 and math.isfinite(ep.estimate.seconds)
    # the experts' gradients are reduced over data alone, the rest over data x expert: fewer bytes than data=8
    assert ep.estimate.comm_bytes > 0


@pytest.mark.timeout(600)
def test_predict_mixtral_on_an_expert_mesh():
    from openhosti_jax.planner.predict import predict

    p = model_preset("mixtral-8x7b", seq_len=4096)
    r = predict(
        p.init,
        optax.adamw(1e-4),
        p.sample_batch(256),
        "64xH100",
        mesh="fsdp=8,expert=8",
        remat="dots",
        model_flops_per_token=p.flops_per_token,
    )
    assert r.plan.mesh_shape["expert"] == 8 and r.plan.data_parallel_size == 64
    assert 0.2 < r.mfu < 0.6
    assert r.time["exposed"] > 0  # the token all-to-alls wait


@pytest.mark.timeout(600)
def test_planner_ranks_expert_meshes_for_mixtral():
    from openhosti_jax.planner.choose import choose_plan

    p = model_preset("mixtral-8x7b", seq_len=4096)
    _, report = choose_plan(  # exhaustive: the ranking of every candidate (a pruned one lists those that can win)
        p.init,
        optax.adamw(1e-4),
        p.sample_batch(256),
        cluster=cluster("64xH100"),
        remat="auto",
        precision="auto",
        exhaustive=True,
    )
    labels = [r.label for r in report.candidates]
    for e in (2, 4, 8):  # every expert axis that divides the 8 experts and fits in a host of 8
        assert any(f"expert={e} " in x for x in labels)
    assert not any("expert=16" in x for x in labels)
    assert report.predicted_seconds > 0 and math.isfinite(report.predicted_seconds)
