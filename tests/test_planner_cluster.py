"""Planning for a cluster that is not attached: hierarchical collective prices against their closed forms, the
prediction's parts against the formulas they stand for, tensor parallelism seen through scanned layers, query-blocked
attention against whole attention, and `openhosti predict`."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from openhosti_jax.cli import main
from openhosti_jax.errors import PlanningError
from openhosti_jax.flops import CAUSAL_ATTENTION_COUNTED
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.models.presets import model_preset
from openhosti_jax.planner.cluster import Cluster, cluster
from openhosti_jax.planner.cost import estimate, matmul_efficiency
from openhosti_jax.planner.predict import model_flops_per_example, predict
from openhosti_jax.planner.profiles import PROFILES, bus_bytes
from openhosti_jax.planner.search import Candidate, score
from openhosti_jax.planner.workload import workload
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.state.model import model_parts

H100 = PROFILES["H100"]


def test_cluster_names_and_axis_placement():
    assert (cluster("8xH100").hosts, cluster("8xH100").devices_per_host) == (1, 8)
    assert (cluster("2x4xH100").hosts, cluster("2x4xH100").devices_per_host) == (2, 4)
    v5p = cluster("v5p-128")
    assert (v5p.hosts * v5p.devices_per_host, v5p.profile.name) == (64, "TPU v5p")
    # the innermost axes fill a host: tensor, then fsdp, then data, then stage
    f = cluster("64xH100").factors({"stage": 2, "data": 4, "fsdp": 4, "tensor": 2})
    assert f == {"stage": (1, 2), "data": (1, 4), "fsdp": (4, 1), "expert": (1, 1), "context": (1, 1), "tensor": (2, 1)}
    with pytest.raises(PlanningError, match="unknown cluster"):
        cluster("64xB9000")


def test_every_device_type_has_a_cited_profile():
    kinds = {"H100", "H200", "A100", "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e"}
    assert kinds <= set(PROFILES)
    for name in kinds:
        p = PROFILES[name]
        assert p.sources and all(p.sources), name
        assert p.memory_bytes and p.peak_flops > 0 and p.dcn_bandwidth > 0
        # a host's network is slower than its own links, which are slower than the device's memory
        assert p.dcn_bandwidth < p.link_bandwidth["all_reduce"] < p.memory_bandwidth, name
        assert p.fp8_flops is None or p.fp8_flops >= p.peak_flops, name


def test_a_tpu_slice_is_one_ici_domain_and_slices_meet_over_dcn():
    one, two = cluster("v5p-128"), cluster("2xv5p-128")
    assert (one.hosts, one.devices_per_host, two.hosts, two.devices_per_host) == (1, 64, 2, 64)
    v5p = PROFILES["TPU v5p"]
    mesh = {"stage": 1, "data": 2, "fsdp": 64, "tensor": 1}
    # all 64 chips of a slice all-reduce over ICI alone; the second slice adds DCN
    assert one.collective_seconds("all_reduce", 2**30, {**mesh, "data": 1}, ("fsdp",)) == v5p.collective_seconds(
        "all_reduce", 2**30, 64
    )
    assert two.collective_seconds("all_reduce", 2**30, mesh, ("data",)) == pytest.approx(
        v5p.dcn_latency + 2 * (1 / 2) * 2**30 / v5p.dcn_bandwidth
    )


def test_a_pipeline_stage_syncs_only_its_own_layers_gradients():
    """stage=2 x data=4 against data=4 alone: each device all-reduces half the gradient bytes,
    2 (n-1)/n x (gradient bytes / S)."""
    cfg = GPTConfig(n_layers=4, d_model=256, n_heads=4, seq_len=64, vocab_size=512, scan_layers=True)
    w = workload(lambda r: GPT(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((16, 64), jnp.int32))
    grads = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(w.params))
    tx = optax.adam(1e-3)
    flat = score(w, tx, Candidate({"stage": 1, "data": 4, "fsdp": 1, "tensor": 1}, 0), Cluster(H100, 1, 4))
    piped = score(w, tx, Candidate({"stage": 2, "data": 4, "fsdp": 1, "tensor": 1}, 0, microbatches=4), H100)
    assert flat.estimate.comm_bytes == pytest.approx(2 * 3 / 4 * grads)
    assert piped.estimate.comm_bytes == pytest.approx(2 * 3 / 4 * grads / 2)


def test_a_collective_across_hosts_is_priced_in_the_host_then_across():
    """2 hosts of 8: an all-reduce over 16 devices is a reduce-scatter and an all-gather over NVLink (8) and an
    all-reduce of each device's eighth across the two hosts over its NIC: the sum of the three closed forms, each at
    its link's measured fraction for its message (1 GiB in the host: 463.58 of 482.26 GB/s on 8 H200; 128 MiB
    across: 35.03 of a NIC's 50 GB/s in a 4-node all-reduce of 1 GiB)."""
    c = Cluster(H100, 2, 8)
    nbytes = 2**30
    mesh = {"stage": 1, "data": 2, "fsdp": 8, "tensor": 1}
    nvlink = 2 * bus_bytes("all_gather", nbytes, 8) / (H100.link_bandwidth["all_gather"] * 463.58 / 482.26)
    network = 2 * (1 / 2) * (nbytes / 8) / 35.03e9
    assert c.collective_seconds("all_reduce", nbytes, mesh, ("data", "fsdp")) == pytest.approx(nvlink + network)
    # inside one host it is the profile's own price; an axis across hosts alone pays only the network
    assert c.collective_seconds("all_reduce", nbytes, mesh, ("fsdp",)) == H100.link_seconds("all_reduce", nbytes, 8)
    assert c.collective_seconds("all_gather", 2**27, mesh, ("data",)) == pytest.approx((2**27 / 2) / 35.03e9)
    # without measured curves (a TPU profile) the alpha-beta lines: one latency per host doubling
    v4 = Cluster(PROFILES["TPU v4"], 2, 4)
    assert v4.collective_seconds("all_gather", nbytes, {**mesh, "fsdp": 4}, ("data",)) == pytest.approx(
        v4.profile.dcn_latency + (nbytes / 2) / v4.profile.dcn_bandwidth
    )


def test_one_host_prices_as_the_profile_alone_and_more_hosts_cost_more():
    params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    tx = optax.adam(1e-3)
    w = workload(lambda r: params, jax.ShapeDtypeStruct((64, 4096), jnp.float32))
    plan = ShardingPlan.from_zero(params, tx, {"data": 16}, 0)
    alone = estimate(plan, w, tx, H100)
    assert estimate(plan, w, tx, Cluster(H100, 1, 16)).seconds == alone.seconds
    assert estimate(plan, w, tx, Cluster(H100, 2, 8)).time["collectives"] > alone.time["collectives"]


def test_a_prediction_is_its_parts_and_its_throughput_the_formula():
    """A data-parallel GPT on 8 H100: compute is the traced training FLOPs over peak x the matmul efficiency of
    its GEMMs at 8 examples each (`matmul_efficiency`); tokens/s
    and MFU follow from the step time by their definitions; with overlap the step is the longer of work and
    collectives, without it their sum."""
    cfg = GPTConfig(n_layers=4, d_model=512, n_heads=8, seq_len=256, vocab_size=1024)
    init = lambda r: GPT(cfg, rngs=nnx.Rngs(r))  # noqa: E731
    batch = jax.ShapeDtypeStruct((64, 256), jnp.int32)
    w = workload(init, batch)
    p = predict(init, optax.adamw(1e-4), batch, "8xH100", mesh="data=8", precision="fp32")
    flops = w.flops_per_example * 64 / 8
    eff = matmul_efficiency(w, H100, 8, 1, 0.0)
    assert p.time["compute"] == pytest.approx(flops / (H100.peak_flops * eff), rel=1e-9)
    assert 0 < eff < H100.matmul_efficiency  # 2,048 tokens by 512 features: small GEMMs
    assert p.tokens_per_second_per_device == pytest.approx(64 * 256 / p.step_seconds / 8)
    assert p.mfu == pytest.approx(p.tokens_per_second_per_device * p.model_flops_per_token / H100.peak_flops)
    work_s = p.time["compute"] + p.time["memory"] + p.time["offload"] + p.time["bubble"]
    assert p.step_seconds == pytest.approx(
        max(work_s, p.time["collectives"]) if H100.overlap else work_s + p.time["collectives"]
    )
    serial = dataclasses.replace(H100, overlap=False)
    q = predict(init, optax.adamw(1e-4), batch, Cluster(serial, 1, 8), mesh="data=8", precision="fp32")
    assert q.step_seconds == pytest.approx(work_s + q.time["collectives"])
    with pytest.raises(PlanningError, match="spans 4 devices"):
        predict(init, optax.adamw(1e-4), batch, "8xH100", mesh="data=4")


def test_tensor_parallelism_is_seen_through_scanned_layers():
    """The same GPT with its blocks in a list and scanned: the tensor axis splits the same matmul FLOPs."""
    batch = jax.ShapeDtypeStruct((8, 64), jnp.int32)
    split = []
    for scan in (False, True):
        w = workload(lambda r, s=scan: GPT(GPTConfig(n_layers=3, d_model=128, scan_layers=s), rngs=nnx.Rngs(r)), batch)
        c = Candidate({"stage": 1, "data": 1, "fsdp": 1, "tensor": 4}, 0)
        split.append(score(w, optax.adam(1e-3), c, H100).estimate.time["compute"])
    assert split[1] == pytest.approx(split[0], rel=1e-6)
    unsplit = workload(lambda r: GPT(GPTConfig(n_layers=3, d_model=128, scan_layers=True), rngs=nnx.Rngs(r)), batch)
    one = score(unsplit, optax.adam(1e-3), Candidate({"stage": 1, "data": 1, "fsdp": 1, "tensor": 1}, 0), H100)
    assert split[1] < 0.5 * one.estimate.time["compute"]


@pytest.mark.slow  # 18 s on the 2-core machine: too long for the fast suite
@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.timeout(120)
def test_query_blocked_attention_equals_whole_attention_and_saves_the_square(family):
    cls, cfg = (GPT, GPTConfig) if family == "gpt" else (Llama, LlamaConfig)
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, 256)
    results, saved = [], []
    for block in (None, 16):
        init = lambda r, b=block: cls(cfg.tiny(n_layers=2, seq_len=64, attention_block=b), rngs=nnx.Rngs(r))  # noqa: E731
        parts = model_parts(init, tokens)
        params, state = parts.init(jax.random.key(0))
        loss = lambda p, f=parts.apply_fn, s=state: jnp.mean(f(p, tokens, model_state=s) ** 2)  # noqa: E731
        results.append(jax.value_and_grad(loss)(params))
        saved.append(workload(init, jax.ShapeDtypeStruct((2, 64), jnp.int32)).activation_bytes_per_example)
    (l0, g0), (l1, g1) = results
    assert abs(float(l1 - l0)) <= 1e-6 * abs(float(l0))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(float(jnp.max(jnp.abs(a))), 1e-6)
    heads = cfg.tiny().n_heads
    # the whole attention keeps each layer's 64 x 64 probabilities per head; the blocked one keeps none of them
    assert saved[0] - saved[1] >= 2 * heads * 64 * 64 * 4 * 0.9


def test_openhosti_predict_prints_a_prediction(capsys):
    assert (
        main(
            [
                "predict",
                "--model",
                "llama3-8b",
                "--cluster",
                "8xH100",
                "--global-batch",
                "64Ktok",
                "--mesh",
                "fsdp=8",
                "--remat",
                "full",
                "--precision",
                "bf16",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["global_batch"] == 8 and out["mesh"]["fsdp"] == 8 and out["remat"] == "full"
    assert 0 < out["mfu"] < 1 and out["fits"] is True
    preset = model_preset("llama3-8b")
    assert out["tokens_per_second_per_device"] * preset.flops_per_token / H100.peak_flops == pytest.approx(out["mfu"])
    assert main(["predict", "--layers", "4", "--cluster", "8xH100", "--global-batch", "8"]) == 2
    assert "missing --d-model" in capsys.readouterr().err
    assert main(["predict", "--model", "gpt3-175b", "--cluster", "64xH100", "--global-batch", "1000tok"]) == 2


def test_plans_for_a_large_cluster_fit_the_device():
    """GPT-3 175B on 64 H100 (8 hosts), planned from abstract shapes: the chosen plan fits 80 GB per device, and
    plain data parallelism does not: every device holds the fp32 parameters and Adam's two moments, 12 bytes each."""
    m = model_preset("gpt3-175b")
    batch = jax.ShapeDtypeStruct((1536, 2048), jnp.int32)
    chosen = predict(m.init, optax.adamw(1e-4), batch, "64xH100", model_flops_per_token=m.flops_per_token)
    assert chosen.fits and chosen.plan.mesh_shape["data"] < 64
    ddp = predict(m.init, optax.adamw(1e-4), batch, "64xH100", mesh="data=64", zero=0)
    assert not ddp.fits and ddp.memory["state"] == pytest.approx(12 * m.config.num_params(), rel=1e-6)
    assert math.isclose(chosen.tokens_per_step, 1536 * 2048)


@pytest.mark.parametrize("shape", [{}, {"ffn": 96, "head_dim": 24}])
def test_gpt_widths_count_parameters_and_flops_exactly(shape):
    """The GPT family's closed forms against the built model: its parameter count and the traced matmul FLOPs
    (MaxText's 2023 v5p shapes need an MLP width that is no multiple of d_model and heads wider than d/heads): the
    trace computes attention's whole square, ``12 L s a`` per token, the model FLOPs count its causal half."""
    cfg = GPTConfig.tiny(**shape)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == cfg.num_params()
    w = workload(lambda r: GPT(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((2, cfg.seq_len), jnp.int32))
    masked = 12 * cfg.n_layers * cfg.seq_len * cfg.attention_width * (1 - CAUSAL_ATTENTION_COUNTED)
    assert w.flops_per_example / cfg.seq_len == pytest.approx(cfg.flops_per_token() + masked, rel=1e-9)
    assert model_flops_per_example(w) / cfg.seq_len == pytest.approx(cfg.flops_per_token(), rel=1e-9)


def test_tensor_split_weights_all_reduce_their_activations_per_layer_in_any_layout():
    from jax.sharding import PartitionSpec as P

    from openhosti_jax.planner.cost import _tensor_activation_width as width

    assert width((512, 2048), P("tensor", None), False) == (2048, 1)  # row-parallel: its output
    assert width((512, 2048), P(None, "tensor"), False) == (512, 1)  # column-parallel: its input's gradient
    assert width((512, 8, 64), P(None, "tensor", None), False) == (512, 1)  # einsum q/k/v kernel
    assert width((8, 64, 512), P("tensor", None, None), False) == (512, 1)  # einsum output kernel
    assert width((24, 512, 2048), P(None, None, "tensor"), True) == (512, 24)  # a scanned stack, per layer
    assert width((24, 512, 2048), P(None, None, None), True) == (0, 24)
    assert width((512,), P("tensor"), False)[0] == 0  # a bias is added, not multiplied
