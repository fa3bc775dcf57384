"""Software stacks, as data: what the training program does with the hardware, which the cost model prices next to
the device profile (`openhosti_jax.planner.profiles`). Two runs on the same GPUs differ by how the framework
executes the same model: whether elementwise ops are fused into few kernels or run one kernel each (eager
PyTorch), whether attention is a flash kernel (scores kept on chip, the causal half skipped) or materialises its
``seq x seq`` scores in memory, and whether the tensor-parallel and gradient collectives overlap compute or wait
for it. `STACKS` holds the openhosti (XLA) default and the stacks of the published runs `benchmarks/scale.py`
compares with, each citing where its traits come from; a `Cluster` carries one (`Cluster.stack`).

Example:
    >>> from openhosti_jax.planner.stacks import STACKS
    >>> s = STACKS["megatron-2021"]
    >>> s.fused, s.flash_attention, s.tensor_overlap
    (True, False, False)
    >>> s.score_bytes  # HBM bytes per fp16 score element, forward + backward (the kernels are listed in STACKS)
    30.0
"""

from __future__ import annotations

import dataclasses

from openhosti_jax.errors import PlanningError


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
    sources: tuple[str, ...] = ()
    """Where the traits come from."""

    def __post_init__(self) -> None:
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
        sources=_MEGATRON_2021,
    ),
    "megatron-core": Stack(
        "megatron-core",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=_CUDNN_H100_EFFICIENCY,
        tensor_overlap=True,
        pipeline_expert=True,
        sources=(*_MCORE, *_CUDNN_H100, _MCORE_MOE),
    ),
    "torchtitan": Stack(
        "torchtitan",
        fused=False,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=0.31,
        tensor_overlap=False,
        sources=(*_TITAN, _FA2_H100),
    ),
    "torchtitan-compile": Stack(
        "torchtitan-compile",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=0.31,
        tensor_overlap=False,
        sources=(*_TITAN, _FA2_H100, "the rows '+ torch.compile': Inductor fuses the elementwise ops"),
    ),
    "maxtext": Stack(
        "maxtext",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        tensor_overlap=False,
        compiler_remat=True,
        sources=(
            "AI-Hypercomputer/maxtext on TPU: XLA-fused ops, the splash / flash Pallas attention kernel (skipping the "
            "causal mask's blocks; no published rate, so priced on the matmul curve); no collective matmul in the "
            "configs compared; XLA's rematerialization pass left on (the v5p scripts' LIBTPU_INIT_ARGS do not "
            "disable it, as the A3 scripts' XLA_FLAGS do)",
        ),
    ),
    "maxtext-gpu": Stack(
        "maxtext-gpu",
        fused=True,
        flash_attention=True,
        causal_skip=True,
        attention_efficiency=_CUDNN_H100_EFFICIENCY,
        tensor_overlap=False,
        sources=(
            "AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/1vm.sh @ efb6d9e4a: XLA-fused ops, "
            "attention=cudnn_flash_te (Transformer Engine's cuDNN flash attention)",
            _CUDNN_H100[0],
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
