"""Software stacks, as data: what the training program does with the hardware, which the cost model prices next to
the device profile (`openhosti_jax.planner.profiles`). Two runs on the same GPUs differ by how the framework
executes the same model: whether elementwise ops are fused into few kernels or run one kernel each (eager
PyTorch), whether attention is a flash kernel (scores kept on chip, the causal half skipped) or materialises its
``seq x seq`` scores in memory, and whether the tensor-parallel and gradient collectives overlap compute or wait
for it. They differ in memory too: what a peer stack's activation checkpointing keeps per layer comes from its own
published recipe (`Stack.saves`, priced by `openhosti_jax.planner.recipes`), its loss head's logits at its own bytes
per element (`Stack.logits_bytes`), and whether it shards the optimizer state over the context axis
(`Stack.optimizer_over_context`); this library's own step is priced from its residual trace. `STACKS` holds the
openhosti (XLA) default and the stacks of the published runs `benchmarks/scale.py` compares with, each citing where
its traits come from; a `Cluster` carries one (`Cluster.stack`).

Example:
    >>> from openhosti_jax.planner.stacks import STACKS
    >>> s = STACKS["megatron-2021"]
    >>> s.fused, s.flash_attention, s.tensor_overlap
    (True, False, False)
    >>> s.score_bytes  # HBM bytes per fp16 score element, forward + backward (the kernels are listed in STACKS)
    30.0
    >>> STACKS["megatron-core"].saves["dots"]  # selective recomputation: all but the attention core, as published
    ('input', 'residual', 'norms', 'qkv', 'context', 'mlp_in', 'mlp_act', 'dropout_masks')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from openhosti_jax.errors import PlanningError

LAYER_TENSORS: tuple[str, ...] = (
    "input",
    "residual",
    "norms",
    "qkv",
    "context",
    "attn_out",
    "mlp_in",
    "mlp_act",
    "mlp_out",
    "every_other",
    "dropout_masks",
)
"""The tensors of a transformer layer a stack's checkpointing rule may keep (`Stack.saves`), each per token: ``input``
the layer's input (what full recomputation keeps; a scan's carry), ``residual`` the residual stream between
attention and the MLP, ``norms`` the two norms' outputs (the projections' inputs), ``qkv`` the query, key and value
projections' outputs, ``context`` attention's output (the out projection's input; what a flash kernel keeps),
``attn_out`` the out projection's output, ``mlp_in`` the MLP's input projections' outputs, ``mlp_act`` its
activation's output, ``mlp_out`` its output projection's, ``every_other`` the 1st, 3rd, 5th, ... projections'
outputs in the order the forward calls them, ``dropout_masks`` the two hidden dropouts' masks (a byte per
element). Their widths come from the model's trace (`openhosti_jax.planner.recipes.layer_shape`)."""
EVERY_RESIDUAL: tuple[str, ...] = ("input", "residual", "norms", "qkv", "context", "mlp_in", "mlp_act")
"""What a fused transformer layer's backward reads with a flash attention kernel and no dropout: Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, section 4.1: 34 sbh + 5 a
s^2 b bytes per GPT layer in fp16, dropout masks included) without the attention core's s^2 terms, which a flash
kernel does not keep; for a GPT layer (q = h, k + v = 2h, MLP 4h) 32 sbh, and 34 sbh with the masks."""
_FULL = ("input",)
_MEGATRON_SELECTIVE = (*EVERY_RESIDUAL, "dropout_masks")
_MAXTEXT_MINIMAL = ("input", "qkv", "attn_out", "mlp_in", "mlp_out")
_TORCHTITAN_OP_SAC = ("input", "every_other", "context")


@dataclasses.dataclass(frozen=True)
class Stack:
    """How a training framework runs a step, as far as the cost model prices it."""

    name: str
    fused: bool = True
    """Whether the elementwise ops between matmuls are fused (a compiler: XLA, torch.compile; hand-written fused
    kernels) so that only the saved activations cross device memory; False (eager): every op is a kernel that
    reads its inputs from and writes its output to device memory (`Workload.elementwise_bytes`)."""
    flash_attention: bool = True
    """Whether attention is one fused kernel that keeps each score block on chip (FlashAttention, cuDNN, a TPU
    splash kernel): no ``seq x seq`` tensor crosses memory. False: the scores are written and read by separate
    kernels, ``score_bytes`` per forward score element (`Workload.attention_scores`)."""
    causal_skip: bool = False
    """Whether the attention kernel skips the masked half of a causal model's scores (flash kernels do; the library's
    query-blocked XLA attention computes every block and masks it, as the trace counts)."""
    attention_efficiency: float | None = None
    """Fraction of the bf16 peak the attention kernel reaches (forward + backward; None: its matmuls are priced on
    the device's GEMM curve like the projections)."""
    score_bytes: float = 0.0
    """Without flash attention: device-memory bytes per forward score element over forward and backward (the
    forward once more where the remat policy recomputes attention)."""
    score_bytes_forward: float = 0.0
    """The forward's part of ``score_bytes`` (what a recomputation pays again)."""
    tensor_overlap: bool = True
    """Whether tensor-parallel activation collectives overlap the matmuls around them (Megatron-Core's
    ``--tp-comm-overlap``, async TP, collective matmul); False: each waits on the matmul before it and the next
    waits on it, so its time adds to the step."""
    grad_overlap: bool = True
    """Whether the gradient reduction (and ZeRO's parameter gather) overlaps the backward (PyTorch DDP's buckets,
    FSDP's prefetch, XLA's latency-hiding scheduler); False: it runs after the backward (Megatron's
    ``--DDP-impl local``)."""
    compiler_remat: bool = False
    """Whether the compiler recomputes saved activations when a step would overflow device memory (XLA's HLO
    rematerialization pass, on by default; MaxText's GPU scripts turn it off with
    ``--xla_disable_hlo_passes=rematerialization``): a plan over the device's memory recomputes the overflow,
    priced as that share of the way from its remat policy to full recomputation, in bytes and in FLOPs. False:
    what overflows does not run (this library's plans are sized to fit, then checked by an ahead-of-time
    compile)."""
    pipeline_tensor: bool = True
    """Whether a pipeline stage splits its layers over the tensor axis too (Megatron, torchtitan, MaxText and this
    library run tensor and sequence parallelism inside each stage); False: the stages split only the batch, so a
    pipelined mesh has no tensor axis."""
    attention_on: tuple[str, ...] | None = None
    """Device kinds (`DeviceProfile.name`) whose attention kernel ``causal_skip`` and ``attention_efficiency``
    describe; elsewhere the stack's attention is priced as plain fused XLA ops (None: every kind)."""
    attention_half_only: bool = False
    """Whether that kernel runs only in half precision (cuDNN's flash attention: bf16 / fp16); an fp32 step's
    attention is then priced as plain fused XLA ops."""
    splash_on: tuple[str, ...] = ()
    """Device kinds whose attention is a TPU splash kernel instead (this library's on TPU:
    `openhosti_jax.models.splash`): fused, no score tile in memory, the causal mask's blocks skipped, in bf16 and
    fp32 alike, priced on the matmul curve (no published rate); ``attention_on``, ``attention_efficiency`` and
    ``attention_half_only`` describe the other kernel."""
    pipeline_context: bool = True
    """Whether a pipeline stage splits its sequences over a context axis too (Megatron-Core, MaxText and
    torchtitan compose context parallelism with their pipelines); False: a pipelined mesh has no context axis."""
    collective_matmul: bool = False
    """Whether the stack runs an unpipelined sequence-parallel plan's tensor-parallel projections as collective
    matmuls (`openhosti_jax.sharding.ShardingPlan.collective_matmul`): the all-gather and reduce-scatter are rings of
    steps each beside a matmul, so where the device overlaps collectives with compute (`DeviceProfile.overlap`)
    the tensor collectives of such a plan hide as ``tensor_overlap``'s do."""
    context_sequence_parallel: bool = True
    """Whether a plan that splits sequences over ``context`` can split the blocks' activations along the sequence
    over ``tensor`` too without collective matmuls; False (this library): only a plan whose projections are
    collective matmuls does (`openhosti_jax.state.jit.activation_context` says why)."""
    padded_expert_exchange: bool = False
    """Whether an expert-parallel layer exchanges fixed-size buffers: a dropless layer sends each device a row for
    every assignment it routes (``expert`` times the rows routed: the worst case, all to one device), a capacity
    layer each expert a slot for every local token up to the call's capacity; False: only the rows routed move
    (a variable-size all-to-all: NCCL's, or `jax.lax.ragged_all_to_all`)."""
    pipeline_expert: bool = False
    """Whether a pipeline stage runs its mixture-of-experts layers expert-parallel over an ``expert`` axis (each
    device routes its share of the batch and holds and runs its slice of the experts, their optimizer state split
    over ``expert`` as the unpipelined path's, tokens exchanged by all-to-alls per microbatch and MoE layer);
    False: a pipelined mesh has no expert axis."""
    saves: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """This library's remat policy name (as a run on the stack is priced) -> the layer tensors (`LAYER_TENSORS`) the
    stack's own activation checkpointing keeps per layer for it, from its published recipe
    (`openhosti_jax.planner.recipes.saved_bytes`); a policy not listed, and every policy of this library's stack,
    keeps what this library's residual trace does."""
    logits_bytes: float | None = None
    """Bytes per logit element the stack's loss holds when the backward starts (its saved softmax or log-softmax
    and the logits' cotangent), with `saves`; None: this library's trace (fp32 logits and their fp32 cotangent)."""
    optimizer_over_context: bool = False
    """Whether the stack shards the optimizer state over the ``context`` axis too (as over the data-parallel
    ones: Megatron-Core's distributed optimizer, torchtitan's FSDP, MaxText's FSDP rules); False (this library):
    ZeRO shards over the data, fsdp and expert axes only, so a context split keeps a whole optimizer state."""
    sources: tuple[str, ...] = ()
    """Where the traits come from."""

    def __post_init__(self) -> None:
        unknown = sorted({n for names in self.saves.values() for n in names} - set(LAYER_TENSORS))
        if unknown:
            raise PlanningError(
                f"stack {self.name!r}: saves names layer tensors {unknown}; expected names from {LAYER_TENSORS}"
            )
        if self.saves and not (isinstance(self.logits_bytes, int | float) and self.logits_bytes > 0):
            raise PlanningError(
                f"stack {self.name!r}: a recipe (saves) needs the loss head's logits_bytes > 0; found "
                f"{self.logits_bytes!r}: give the bytes per logit element its loss holds (fp32: 8, a saved fp32 "
                "softmax with a bf16 cotangent: 6)"
            )
        if self.attention_efficiency is not None and not 0 < self.attention_efficiency <= 1:
            raise PlanningError(
                f"stack {self.name!r}: attention_efficiency={self.attention_efficiency!r} must be in (0, 1] or None"
            )
        if not 0 <= self.score_bytes_forward <= self.score_bytes:
            raise PlanningError(
                f"stack {self.name!r}: need 0 <= score_bytes_forward <= score_bytes; found "
                f"{self.score_bytes_forward} and {self.score_bytes}"
            )
        if self.flash_attention and self.score_bytes:
            raise PlanningError(f"stack {self.name!r}: a flash attention kernel moves no scores; set score_bytes=0")

    def on(self, kind: str, half: bool) -> Stack:
        """This stack as its attention runs on device kind ``kind`` (`DeviceProfile.name`) in half precision
        (``half``) or not: ``splash_on``'s kernel there; ``attention_on``'s where it runs (and the precision is
        half where ``attention_half_only``); else plain fused XLA ops (every block computed, the matmul rate).

        >>> own = STACKS["openhosti"]
        >>> [(s.causal_skip, s.attention_efficiency is None) for s in (own.on("TPU v5p", False), own.on("A100", True))]
        [(True, True), (False, True)]
        """
        if kind in self.splash_on:
            return dataclasses.replace(
                self, flash_attention=True, score_bytes=0.0, score_bytes_forward=0.0, causal_skip=True,
                attention_efficiency=None,
            )  # fmt: skip
        if (self.attention_on is not None and kind not in self.attention_on) or (self.attention_half_only and not half):
            return dataclasses.replace(self, causal_skip=False, attention_efficiency=None)
        return self


_MEGATRON_2021 = (
    "NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh and CONFIG.sh (the Table 1 runs: "
    "--fp16, DDP-impl torch for 1.7B-18B, local from 39B, uniform full recomputation, interleaving where given)",
    "Megatron-LM 2021 (megatron/model/transformer.py, fused_softmax.py): attention scores are a baddbmm output, "
    "then FusedScaleMaskSoftmax, attention dropout (0.1), then bmm with the values: no flash kernel; tensor-parallel "
    "all-reduces are synchronous in the forward (RowParallelLinear) and backward (ColumnParallelLinear)",
)
_MCORE = (
    "NVIDIA/Megatron-LM README.md (Megatron-Core r0.8.0 benchmark configuration: 'Fine-grained overlapping with DP "
    "(--overlap-grad-reduce, --overlap-param-gather), TP (--tp-comm-overlap), and PP'); Transformer Engine's "
    "fused (flash / cuDNN) attention",
)
_TITAN = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Table 1 and 3 rows 'FSDP': no torch.compile; "
    "FSDP2 prefetches the next layer's all-gather and reduce-scatters during the backward)",
    "torchtitan models/llama/model.py @ 9dec370: F.scaled_dot_product_attention(is_causal=True), which runs the "
    "FlashAttention-2 backend on H100 in torch 2.5-2.6",
)
_FA2_H100 = (
    "Dao-AILab/flash-attention README, assets/flash2_h100_fwd_bwd_benchmark.png: FlashAttention-2 forward + "
    "backward on H100 80GB SXM5, head dim 128, 8k tokens: 308 TFLOP/s causal (335 without the mask), 0.31 of the "
    "989 peak; pytorch/pytorch#138522 (in 2.5.1: cuDNN attention last in SDPA's order, so flash is taken) and "
    "pytorch/pytorch#142132 (nightly 2024-12-04 on H100: SDPA 329.5 TFLOP/s, cuDNN 631.3, 'This is expected')"
)
_CUDNN_H100 = (
    "Shah et al. 2024, FlashAttention-3 (arXiv 2407.08608), attention speed on H100 80GB SXM5 at 4k tokens, head "
    "dim 128, BF16: cuDNN forward with the causal mask 518 TFLOP/s, backward 499 (the cuDNN bars of its forward "
    "and backward figures)",
    "NVIDIA/NeMo docs memory_optimizations.rst (NVIDIA/NeMo#9188): 'Transformer Engine prefers cuDNN flash "
    "attention on Hopper+ architectures'",
)


def _step_efficiency(forward: float, backward: float, peak: float) -> float:
    """Fraction of ``peak`` an attention kernel sustains over forward and backward, from its measured rate in each:
    the backward does 2.5x the forward's FLOPs (five matmuls to two), as FlashAttention's benchmarks count."""
    return 3.5 / (1 / forward + 2.5 / backward) / peak


_CUDNN_H100_EFFICIENCY = _step_efficiency(518e12, 499e12, 989e12)
_MEGATRON_2021_RECIPE = (
    "NVIDIA/Megatron-LM @ v2.5: --checkpoint-activations (run_table_1.sh) keeps each layer's input and recomputes "
    "the layer; megatron/model/gpt_model.py line 56 casts the logits to fp32 (output.float()) and "
    "megatron/mpu/cross_entropy.py lines 69-80 exponentiate them in place and save that softmax (4 bytes per "
    "element), the gradient made in it and handed back in fp16 (2): 6 bytes per logit element, vocab-parallel"
)
_MCORE_RECIPE = (
    "NVIDIA/Megatron-LM megatron/core/transformer/transformer_config.py @ core_r0.8.0 lines 160-167: "
    "recompute_granularity 'selective' recomputes only the attention core (its memory-intensive part), 'full' keeps "
    "each layer's input; lines 43-46: hidden_dropout and attention_dropout default 0.1 (a byte mask per hidden "
    "dropout kept; the fused attention regenerates its own). Korthikanti et al. 2022 (arXiv 2205.05198) section 4: "
    "selective keeps 34 sbh per GPT layer, sbh (10 + 24/t) under tensor parallelism, 34 sbh / t with sequence "
    "parallelism; with a flash core no recomputation keeps the same (the core keeps only its output, which the "
    "out projection keeps anyway)",
    "megatron/core/tensor_parallel/cross_entropy.py @ core_r0.8.0 lines 27, 185 and 88: the logits cast to fp32, "
    "their softmax saved (4 bytes per element), its gradient made in place and handed back to the bf16 output layer "
    "(2): 6 bytes per logit element, vocab-parallel over tensor",
    "megatron/core/optimizer/__init__.py @ core_r0.8.0 line 343: the distributed optimizer shards over "
    "get_data_parallel_group(with_context_parallel=True)",
)
_MAXTEXT_RECIPE = (
    "AI-Hypercomputer/maxtext src/maxtext/layers/decoders.py @ e591f30 lines 326-358: remat_policy 'minimal' saves "
    "query_proj, key_proj, value_proj, out_proj, mlpwi_0, mlpwi_1 and mlpwo, 'minimal_with_context' (formerly "
    "'minimal_flash') the attention context too, 'full' no name: the scanned layer's carry, its input (the v5p "
    "32B's 'minimal' of 2023, checkpoint_dots_with_no_batch_dims, saves the same projections' outputs)",
    "src/maxtext/configs/base.yml @ e591f30 line 193: cast_logits_to_fp32 true (fp32 logits kept for the softmax "
    "cross entropy, with their fp32 cotangent: 8 bytes per element); lines 605-606: 'embed' sharded over fsdp, "
    "fsdp_transpose, context, ...: the parameters and their optimizer state split over the context axis",
)
_TITAN_RECIPE = (
    "pytorch/torchtitan torchtitan/parallelisms/parallelize_llama.py @ 3f20451 (2024-12, the benchmark's) lines "
    "214-222 and 253-259: selective op checkpointing saves the outputs of every other aten.mm in a block (the 1st, "
    "3rd, ...: wq, wv, w1, w2 of a Llama block) and of the flash / efficient SDPA and recomputes the rest; full "
    "checkpointing keeps the block's input",
    "train.py @ 3f20451 lines 132-133 and 307: cross_entropy(pred.flatten(0, 1).float(), ...) keeps the fp32 "
    "log-softmax and makes an fp32 cotangent, the bf16 logits deleted before the backward: 8 bytes per logit element",
    "torchtitan/distributed/parallel_dims.py @ b5bcd76 lines 225-228: the FSDP dimension includes dp_shard and cp",
)
_MCORE_MOE = (
    "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md @ 0b981f9c53: expert parallelism composes with "
    "pipeline and tensor parallelism (its Mixtral 8x7B mapping: TP1 EP8 PP4 VP8), each rank holding its experts' "
    "weights, tokens dispatched by a variable-size all-to-all"
)
STACKS: dict[str, Stack] = {
    "openhosti": Stack(
        "openhosti",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=_CUDNN_H100_EFFICIENCY,
        attention_on=("H100", "H200", "H100 HBM2e"),
        attention_half_only=True,
        splash_on=("TPU v4", "TPU v5e", "TPU v5p", "TPU v6e"),
        tensor_overlap=False,
        collective_matmul=True,
        context_sequence_parallel=False,
        pipeline_context=False,
        padded_expert_exchange=True,
        pipeline_expert=True,
        sources=(
            "this library on XLA: elementwise ops fused; attention on a GPU in bf16/fp16 is cuDNN's fused flash "
            "kernel (openhosti_jax.models.attention.attention_kernel passes implementation='cudnn' to "
            "jax.nn.dot_product_attention, whose implementation=None is XLA's on every backend in jax 0.10; "
            "tests/test_models_attention.py), priced at cuDNN's measured H100 rate with the causal half skipped, "
            "on Hopper only (the rate's source); on a TPU the Pallas splash kernel in bf16 and fp32 "
            "(openhosti_jax.models.splash: attention_kernel picks it from the platform of the mesh the step is "
            "compiled for, tests/test_models_splash.py), the causal mask's blocks skipped, on the matmul curve; "
            "elsewhere query blocks (each block's scores stay in a fusion and "
            "are recomputed in the backward), every block computed and masked; the latency-hiding "
            "scheduler overlaps gradient and ZeRO collectives with other layers' work, but a tensor-parallel "
            "all-reduce sits between two dependent matmuls of one layer, except in an unpipelined sequence-parallel "
            "plan, whose projections are collective matmuls (openhosti_jax.models.collective: rings of ppermute "
            "steps each beside a matmul chunk, tests/test_collective_matmul.py; Wang et al. 2023, ASPLOS, "
            "'Overlap Communication with Dependent Computation via Decomposition'); the "
            "pipeline executor (openhosti_jax.pipeline.executor) splits each stage's batch over data / fsdp and its "
            "layers over tensor by the unpipelined path's tensor-parallel specs (tests/test_pipeline_tensor.py); its "
            "mixture-of-experts layers run expert-parallel inside a stage, the batch split over expert too, each "
            "expert rank holding only its experts and their optimizer state (tests/test_pipeline_moe.py); an "
            "expert-parallel layer exchanges its tokens by jax.lax.all_to_all of fixed-size buffers "
            "(openhosti_jax.models.moe.expert_parallel: XLA:CPU has no ragged-all-to-all)",
            *_CUDNN_H100,
        ),
    ),
    "megatron-2021": Stack(
        "megatron-2021",
        fused=True,
        flash_attention=False,
        # forward: baddbmm writes S (2 B), the fused scale-mask-softmax reads S and writes P (4), dropout reads P,
        # writes P' and its byte mask (5), the bmm with V reads P' (2): 13 B; backward: the bmm dO V^T writes dP'
        # (2), dropout's backward reads dP' and the mask and writes dP (5), the softmax backward reads dP and P and
        # writes dS (6), the two bmms with K and Q read dS (4): 17 B
        score_bytes=30.0,
        score_bytes_forward=13.0,
        tensor_overlap=False,
        grad_overlap=True,
        saves={"full": _FULL},
        logits_bytes=6.0,
        sources=(*_MEGATRON_2021, _MEGATRON_2021_RECIPE),
    ),
    "megatron-core": Stack(
        "megatron-core",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=_CUDNN_H100_EFFICIENCY,
        tensor_overlap=True,
        pipeline_expert=True,
        saves={"none": _MEGATRON_SELECTIVE, "dots": _MEGATRON_SELECTIVE, "full": _FULL},
        logits_bytes=6.0,
        optimizer_over_context=True,
        sources=(*_MCORE, *_CUDNN_H100, _MCORE_MOE, *_MCORE_RECIPE),
    ),
    "torchtitan": Stack(
        "torchtitan",
        fused=False,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=0.31,
        tensor_overlap=False,
        saves={"selective": _TORCHTITAN_OP_SAC, "full": _FULL},
        logits_bytes=8.0,
        optimizer_over_context=True,
        sources=(*_TITAN, _FA2_H100, *_TITAN_RECIPE),
    ),
    "torchtitan-compile": Stack(
        "torchtitan-compile",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=0.31,
        tensor_overlap=False,
        saves={"selective": _TORCHTITAN_OP_SAC, "full": _FULL},
        logits_bytes=8.0,
        optimizer_over_context=True,
        sources=(*_TITAN, _FA2_H100, "the rows '+ torch.compile': Inductor fuses the elementwise ops", *_TITAN_RECIPE),
    ),
    "maxtext": Stack(
        "maxtext",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        tensor_overlap=False,
        compiler_remat=True,
        saves={"dots": _MAXTEXT_MINIMAL, "full": _FULL},
        logits_bytes=8.0,
        optimizer_over_context=True,
        sources=(
            "AI-Hypercomputer/maxtext on TPU: XLA-fused ops, the splash / flash Pallas attention kernel (skipping the "
            "causal mask's blocks; no published rate, so priced on the matmul curve); no collective matmul in the "
            "configs compared; XLA's rematerialization pass left on (the v5p scripts' LIBTPU_INIT_ARGS do not "
            "disable it, as the A3 scripts' XLA_FLAGS do)",
            *_MAXTEXT_RECIPE,
        ),
    ),
    "maxtext-gpu": Stack(
        "maxtext-gpu",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=_CUDNN_H100_EFFICIENCY,
        tensor_overlap=False,
        saves={"dots": (*_MAXTEXT_MINIMAL, "context"), "full": _FULL},
        logits_bytes=8.0,
        optimizer_over_context=True,
        sources=(
            "AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/1vm.sh @ efb6d9e4a: XLA-fused ops, "
            "attention=cudnn_flash_te (Transformer Engine's cuDNN flash attention), remat_policy=minimal_flash",
            _CUDNN_H100[0],
            *_MAXTEXT_RECIPE,
        ),
    ),
}
"""Software stacks by name, each citing its sources (`Stack.sources`)."""


def stack(name: str | Stack) -> Stack:
    """The `Stack` called ``name`` (a `Stack` is returned as is), else a `PlanningError` listing them.

    >>> stack("torchtitan").fused
    False
    """
    if isinstance(name, Stack):
        return name
    if name not in STACKS:
        raise PlanningError(f"unknown software stack {name!r}; expected one of {sorted(STACKS)} or a Stack")
    return STACKS[name]
