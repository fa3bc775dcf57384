"""Peer stacks' saved activations from their published recipes (`openhosti_jax.planner.recipes`): each against the
recipe's own closed form (Korthikanti et al. 2022 for Megatron; MaxText's and torchtitan's saved tensors counted by
hand), and the cost model holding them for a peer stack in place of this library's trace."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from openhosti_jax.errors import PlanningError
from openhosti_jax.models.presets import gpt_shape, llama_shape, model_preset
from openhosti_jax.planner import cost
from openhosti_jax.planner.cluster import Cluster
from openhosti_jax.planner.profiles import PROFILES
from openhosti_jax.planner.recipes import layer_shape, saved_bytes
from openhosti_jax.planner.search import Candidate, score
from openhosti_jax.planner.stacks import STACKS, Stack
from openhosti_jax.planner.workload import workload

S, H, L, V = 256, 512, 3, 1024  # sequence, hidden, layers, vocabulary


def _work(preset):
    return workload(preset.init, preset.sample_batch(1))


GPT = _work(gpt_shape(layers=L, d_model=H, heads=8, vocab=V, seq=S))
LLAMA = _work(llama_shape(layers=L, d_model=H, heads=8, kv_heads=2, ffn=1408, vocab=V, seq=S))


def _mesh(**axes: int) -> dict[str, int]:
    return {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1} | axes


def test_megatron_selective_recomputation_keeps_34_sbh_per_gpt_layer():
    """Korthikanti et al. 2022, section 4 (fp16, per layer, b = 1): selective recomputation keeps 34 sbh;
    with tensor parallelism of t, sbh (10 + 24/t); with sequence parallelism too, 34 sbh / t; full recomputation
    keeps 2 sbh and re-makes one layer's 32 sbh (the masks are not among what the backward re-makes). The loss keeps
    6 bytes per logit (Megatron's fp32 softmax, handed back in bf16), vocab-parallel over t."""
    mcore = STACKS["megatron-core"]
    logits = 6 * V
    assert saved_bytes(mcore, GPT, "dots", 2) == S * (L * 34 * H + logits)
    assert saved_bytes(mcore, GPT, "none", 2) == saved_bytes(mcore, GPT, "dots", 2)  # a flash core keeps no more
    assert saved_bytes(mcore, GPT, "dots", 2, t=4) == pytest.approx(S * (L * H * (10 + 24 / 4) + logits / 4))
    assert saved_bytes(mcore, GPT, "dots", 2, t=4, sequence=True) == pytest.approx(S * (L * 34 * H + logits) / 4)
    assert saved_bytes(mcore, GPT, "full", 2) == S * (L * 2 * H + (32 - 2) * H + logits)
    assert saved_bytes(STACKS["megatron-2021"], GPT, "full", 2) == saved_bytes(mcore, GPT, "full", 2)


def test_maxtext_minimal_keeps_the_projections_outputs():
    """MaxText's 'minimal' keeps query_proj, key_proj, value_proj, out_proj, mlpwi_0, mlpwi_1 and mlpwo, and the scan
    keeps each layer's input; 'minimal_with_context' (the A3 runs' 'minimal_flash', the maxtext-gpu stack) the
    attention output too. A Llama layer of width 512, 8 query heads and 2 key/value heads of 64, SwiGLU 1408."""
    q, kv, f = 512, 2 * 2 * 64, 1408
    minimal = H + (q + kv) + H + 2 * f + H
    remade = H + 2 * H + q + f  # the residual, the norms' outputs, the attention output, the activation
    assert saved_bytes(STACKS["maxtext"], LLAMA, "dots", 2) == S * (2 * (L * minimal + remade) + 8 * V)
    with_context = saved_bytes(STACKS["maxtext-gpu"], LLAMA, "dots", 2)
    assert with_context == S * (2 * (L * (minimal + q) + remade - q) + 8 * V)


def test_torchtitan_op_level_checkpointing_keeps_every_other_matmul():
    """torchtitan's selective op checkpointing keeps the 1st, 3rd, 5th and 7th of a Llama block's matmuls (wq, wv,
    w1, w2), the SDPA output and the block's input; its loss 8 bytes per logit (fp32 log-softmax and cotangent)."""
    q, v, f = 512, 2 * 64, 1408
    kept = H + (q + v + f + H) + q
    every = H + H + 2 * H + (q + 2 * v) + q + 2 * f + f
    remade = every - H - q  # the input and the attention output are kept
    assert saved_bytes(STACKS["torchtitan"], LLAMA, "selective", 2) == S * (2 * (L * kept + remade) + 8 * V)
    assert layer_shape(GPT).every_other == (3 * H + 4 * H, 0)  # qkv and fc of qkv, proj, fc, out


def test_what_no_recipe_covers_is_left_to_the_trace():
    mixtral = _work(model_preset("mixtral-8x7b", n_layers=2, seq_len=64))
    assert layer_shape(mixtral) is None and saved_bytes(STACKS["megatron-core"], mixtral, "dots", 2) is None
    assert saved_bytes(STACKS["openhosti"], GPT, "dots", 2) is None  # this library's own stack: its trace
    assert saved_bytes(STACKS["torchtitan"], GPT, "dots", 2) is None  # torchtitan has no such mode


def test_a_recipe_names_known_tensors_and_its_logits():
    with pytest.raises(PlanningError, match="saves names layer tensors \\['scores'\\]"):
        Stack("x", saves={"dots": ("input", "scores")}, logits_bytes=8.0)
    with pytest.raises(PlanningError, match="logits_bytes"):
        Stack("x", saves={"full": ("input",)})


def test_the_cost_model_holds_a_peer_stacks_recipe_in_place_of_the_trace():
    """Megatron-Core on 8 H100, one sequence per device, bf16, 'dots': the step's activations are the recipe's bytes
    (its loss the logits at the stack's bytes per element) where the same stack without a recipe holds this
    library's trace's."""
    tx = optax.adam(1e-3)
    gpt = gpt_shape(layers=L, d_model=H, heads=8, vocab=V, seq=S)
    work = workload(gpt.init, jax.ShapeDtypeStruct((8, S), jnp.int32))
    c = Candidate(_mesh(fsdp=8), 3, remat="dots", precision="bf16")
    mcore = STACKS["megatron-core"]
    traced = dataclasses.replace(mcore, saves={}, logits_bytes=None)
    held = {}
    for name, s in (("peer", mcore), ("trace", traced)):
        plan = score(work, tx, c, Cluster(PROFILES["H100"], 1, 8, s)).plan
        held[name] = cost._activations(cost._layout(plan, work, tx, Cluster(PROFILES["H100"], 1, 8, s), None, None))
    kept = work.policy_activations("dots", "bf16").bytes_per_example  # the trace's, per sequence
    recipe = saved_bytes(mcore, work, "dots", 2)
    assert recipe != kept
    assert held["peer"].kept == pytest.approx(recipe) and held["trace"].kept == pytest.approx(kept)
    assert held["peer"].loss == pytest.approx(S * V * mcore.logits_bytes)  # the logits, at the stack's bytes


def test_a_peer_stack_shards_its_optimizer_state_over_the_context_axis():
    """Megatron-Core's distributed optimizer, torchtitan's FSDP and MaxText's rules shard the optimizer state over
    the context axis too; this library's ZeRO does not. A Llama on fsdp=4 x context=2: Adam's two fp32 moments,
    8 bytes per parameter over fsdp's 4, are halved again on the peer's stack."""
    tx = optax.adam(1e-3)
    work = workload(model_preset("llama3-8b", n_layers=2, seq_len=S).init, jax.ShapeDtypeStruct((4, S), jnp.int32))
    c = Candidate(_mesh(fsdp=4, context=2), 3, remat="dots", precision="bf16")
    mcore = STACKS["megatron-core"]
    where = {
        over: Cluster(PROFILES["H100"], 1, 8, dataclasses.replace(mcore, optimizer_over_context=over))
        for over in (True, False)
    }
    state = {over: score(work, tx, c, where[over]).estimate.memory["state"] for over in where}
    moments = 8 * sum(x.size for x in jax.tree.leaves(work.params)) / 4
    assert state[False] - state[True] == pytest.approx(moments / 2, rel=1e-6)
    assert not STACKS["openhosti"].optimizer_over_context
