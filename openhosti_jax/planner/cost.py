"""The analytic cost model: per-device memory and per-step time of a `ShardingPlan` for a `Workload`.

Memory (bytes per device): parameters (in the precision policy's dtype) + optimizer state (with its fp32 master
copy) as sharded, the local batch, and the step's temporaries, the largest of three peaks (`_Gradients`): the
backward's start (every saved activation, the loss's included, and the output head's gathered copy and gradient;
the activations are those the remat and precision policies keep, from a trace under them, over the microbatch
count), the loop over a scanned layer stack (its gradient output in its reduced layout, one layer's gathered and
unreduced leaves in flight: the loop reduces each layer's gradient) and the combined reduction of the unstacked
gradients after the backward (full input and output both live; a native reduce-scatter's output is the sharded
gradient; a ZeRO-3 leaf's is reduce-scattered where it is made). Time (seconds): matmul FLOPs (with the remat
policy's recomputation) / (peak x the
profile's matmul efficiency at each matmul's size on one device, `matmul_efficiency`), activation and
optimizer-update bytes / memory bandwidth (measured for the step's working set: its predicted bytes per device), and
every collective priced per message by the profile's link model (all-reduce 2(n-1)/n, all-gather and
reduce-scatter (n-1)/n of the bytes over the bandwidth, at the measured fraction of it for the message's size where
the profile has one), in each host and then across hosts on a `Cluster`; where the profile says the compiler
overlaps collectives with compute, a step takes the longer of the two, else their sum.
Gradient reductions are one message per kind and group: XLA's all-reduce / reduce-scatter combiners merge them
into one op (seen in the compiled HLO), while ZeRO-3 gathers stay one per sharded leaf and layer (gathered per use,
a scanned stack a layer at a time), and tensor-parallel activations one per leaf and microbatch. Without
a native reduce-scatter (CPU) ZeRO-2/3 gradients are all-reduced over the data-parallel devices, as in ZeRO-0/1.
The cluster's software stack (`openhosti_jax.planner.stacks`) adds what the framework does: eager elementwise
kernels' traffic, attention scores written to memory or a flash kernel's rate and causal skip, and the collectives
it cannot overlap (tensor-parallel all-reduces between dependent matmuls, a gradient reduction after the backward),
which add to the step instead of hiding under it; interleaved pipelines divide the bubble by their chunk count.
A mixture-of-experts model (`Workload.experts`) on an ``expert`` axis adds, per MoE layer and microbatch, four
all-to-alls of its tokens' ``top_k`` rows (dispatch and combine, forward and backward; the forward's two again
where remat recomputes the block), exposed (each sits between the router and the experts it feeds); the experts'
grouped matmuls run at the GEMM curve's efficiency for one expert's rows (tokens x top_k / experts, times the
``expert`` axis), their time on the slowest device ``expert_imbalance`` times the balanced one; the dispatch's
gathers and sorts stream through memory.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.planner.cost import estimate
    >>> from openhosti_jax.sharding.plan import ShardingPlan
    >>> from openhosti_jax.planner.profiles import PROFILES
    >>> from openhosti_jax.planner.workload import AttentionWork, PolicyActivations, Workload
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    >>> w = Workload(params, None, None, None, 8, 0.0, 0.0, 1)
    >>> plan = ShardingPlan.from_zero(params, optax.adam(1e-3), {"fsdp": 8}, 3)
    >>> estimate(plan, w, optax.adam(1e-3), PROFILES["H100"]).memory["state"] == 12 * 2**20 // 8 + 4  # + step count
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PlanningError
from openhosti_jax.planner.cluster import Cluster
from openhosti_jax.planner.profiles import DeviceProfile, bus_bytes
from openhosti_jax.planner.recipes import saved_parts
from openhosti_jax.planner.stacks import Stack
from openhosti_jax.planner.workload import AttentionWork, ExpertWork, PolicyActivations, Workload
from openhosti_jax.policies.precision import precision
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.rules import LAYER_AXIS, logical_names
from openhosti_jax.sharding.specs import axis_dim, is_spec, local_shape, spec_axes
from openhosti_jax.sharding.zero import Optimizer
from openhosti_jax.sizes import tree_bytes

EXPERT_IMBALANCE = 1.1
"""Default ratio of the slowest device's routed-expert work to the balanced share on an ``expert`` axis larger than
1. An assumption, not a measurement: the load-balancing loss (Switch Transformer's, weight 0.01, as
`openhosti_jax.models.moe.MoEConfig.aux_loss_weight` defaults) keeps the experts' loads near even but not equal; 1.1
sits inside the 1.0-1.25 capacity factors Switch Transformer trains with (Fedus et al. 2021, section 2.2), the
headroom its authors give the busiest expert. Pass ``expert_imbalance`` to `estimate` to price another."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Predicted per-device memory and per-step time, with their parts."""

    memory: dict[str, float]
    """Bytes per device by part: state, batch, temporaries, total."""
    time: dict[str, float]
    """Seconds per step by part, per device: compute, memory, offload (remat to host), bubble (a pipeline stage's
    idle ticks), collectives, launch (the program's fixed cost), total (with overlap, the longer of work and
    collectives)."""
    comm_bytes: float
    """Bytes each device sends per step (bus traffic of every collective)."""
    tensor_cuts: int = 0
    """Reshapes that cut the tensor-split dim into parts the axis does not divide (e.g. fewer attention heads
    than the tensor axis); a usable tensor split has none."""
    flops_factor: float = 1.0
    """The step's FLOPs over one forward and backward: the remat policy's recomputation and what the compiler's
    rematerialization pass adds to fit (`Stack.compiler_remat`)."""

    @property
    def bytes(self) -> int:
        """Total predicted bytes per device."""
        return int(self.memory["total"])

    @property
    def seconds(self) -> float:
        """Total predicted seconds per step."""
        return self.time["total"]


@functools.lru_cache(maxsize=2**16)
def _block_bytes(shape: tuple[int, ...], itemsize: int, spec: P, sizes: tuple[tuple[str, int], ...]) -> int:
    return math.prod(local_shape(shape, spec, dict(sizes))) * itemsize


_LEAVES: dict[int, tuple[Any, list[P]]] = {}


def _specs(tree: Any) -> list[P]:
    """The spec leaves of ``tree``, remembered for the last few trees (a search prices each plan's specs under many
    policies; the tree is held, so its id stays its own)."""
    if id(tree) not in _LEAVES:
        if len(_LEAVES) >= 64:
            del _LEAVES[next(iter(_LEAVES))]
        _LEAVES[id(tree)] = (tree, jax.tree.leaves(tree, is_leaf=is_spec))
    return _LEAVES[id(tree)][1]


def _group(spec: P, base: P) -> tuple[str, ...]:
    """The axes that shard a leaf beyond its base (tensor-parallel) spec."""
    return tuple(a for a in spec_axes(spec) if a not in spec_axes(base))


def _tensor_activation_width(shape: tuple[int, ...], spec: P, stacked: bool) -> tuple[int, int]:
    """(width of the activation a tensor-split weight's matmul all-reduces per token, layers it stands for); width 0
    when the weight is not tensor-split. A weight split on its first dim (row-parallel, vocab-parallel embedding)
    all-reduces its output (the last dim) forward; one split further in (column-parallel) all-reduces the gradient
    of its input (the first dim) backward. A scanned stack (``stacked``: a leading layers dim) counts per layer."""
    layers = shape[0] if stacked else 1
    dims, entries = (shape[1:], tuple(spec)[1:]) if stacked else (shape, tuple(spec))
    split = axis_dim(P(*entries), "tensor")
    if split is None or len(dims) < 2:
        return 0, layers
    return (dims[-1] if split == 0 else dims[0]), layers


def matmul_efficiency(
    work: Workload,
    profile: DeviceProfile,
    examples: float,
    t: int,
    split_share: float,
    batched: bool | None = None,
    expert: int = 1,
) -> float:
    """The fraction of peak a step's matmuls reach together on one device: each matmul of the workload
    (`Workload.gemm_sizes`) at its size for ``examples`` examples per call (a microbatch), the tensor-split share of
    its FLOPs at ``1 / t`` of that, weighted by FLOPs (the step time of every matmul at its own
    `DeviceProfile.gemm_efficiency`, over the time at the peak); without a trace, the profile's large-GEMM
    efficiency. ``batched``: only the matmuls with (attention's) or without (the projections') batch dims. A grouped
    matmul (a mixture of experts' experts) runs at the size of one group, its rows ``expert`` times as many on an
    ``expert`` axis of that size (each device's experts take the tokens of that many devices).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from openhosti_jax.planner.profiles import PROFILES
        >>> from openhosti_jax.planner.workload import workload
        >>> w = workload(nnx.Linear(1024, 1024, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((1024, 1024), jnp.float32))
        >>> a100 = PROFILES["A100"]
        >>> round(matmul_efficiency(w, a100, 1024, 1, 0.0), 6), round(a100.gemm_efficiency(1024), 6)  # 1024^3 GEMMs
        (0.263697, 0.263697)
    """
    gemms = work.gemm_table(batched)
    if not gemms or not profile.matmul_curve:
        return profile.gemm_efficiency(math.inf)
    key = ("gemm efficiency", profile.matmul_curve, examples, t, split_share, batched, expert)

    def weigh() -> float:
        eff, whole, split = profile.gemm_efficiency, 1 - split_share, split_share / t
        per_peak = sum(
            share * (whole / eff((mnk * n * examples) ** (1 / 3)) + split / eff((mnk * n * examples / t) ** (1 / 3)))
            for mnk, share, grouped in gemms
            for n in [expert if grouped else 1]
        )
        return (whole + split) / per_peak

    return work.memo(key, weigh)


def estimate(
    plan: ShardingPlan,
    work: Workload,
    tx: Optimizer,
    profile: DeviceProfile | Cluster,
    base_specs: Any | None = None,
    sharded_specs: Any | None = None,
    expert_imbalance: float = EXPERT_IMBALANCE,
) -> Estimate:
    """Predicted memory and step time of ``plan`` for ``work`` on devices described by ``profile`` (one host of
    them) or on a `Cluster` (collectives priced in the hosts, then across them).

    ``base_specs`` are the specs before ZeRO (tensor parallel / annotations) and ``sharded_specs`` the fully
    ZeRO-sharded ones; they default to the plan's gradient specs (exact for stage 0 and for stage 3).
    ``expert_imbalance``: the slowest device's routed-expert work over the balanced share on an ``expert`` axis
    (`EXPERT_IMBALANCE`).
    """
    if not (isinstance(expert_imbalance, int | float) and math.isfinite(expert_imbalance) and expert_imbalance >= 1):
        raise PlanningError(f"expert_imbalance={expert_imbalance!r} must be a finite number >= 1 (1: balanced)")
    lay = _layout(plan, work, tx, profile, base_specs, sharded_specs, expert_imbalance)
    acts = _activations(lay)
    mem = _memory(lay, acts)
    comm, updated = _communication(lay, acts)
    time = _step_time(lay, acts, mem, comm, updated)
    return Estimate(mem.parts, time, comm.bus_bytes, acts.cuts, mem.flops_factor)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What every part of an estimate reads: the plan's axis sizes on the cluster, the leaves and their specs."""

    plan: ShardingPlan
    work: Workload
    cluster: Cluster
    sizes: dict[str, int]
    """Mesh axis -> size."""
    sizes_key: tuple[tuple[str, int], ...]
    """``sizes`` as a key for `_block_bytes`."""
    mp: Any
    """The precision policy."""
    policy: PolicyActivations
    """What the remat and precision policies keep per example."""
    params: list[Any]
    """Parameter leaves in the precision policy's dtype."""
    opt: list[Any]
    """Optimizer state leaves."""
    p_specs: list[P]
    g_specs: list[P]
    base: list[P]
    """The gradient specs before ZeRO (tensor parallel / annotations)."""
    sharded: list[P]
    """The fully ZeRO-sharded gradient specs."""
    o_specs: list[P]
    names: list[Any]
    """Each parameter leaf's logical axis names."""
    imbalance: float = EXPERT_IMBALANCE
    """The slowest device's routed-expert work over the balanced share (``expert`` axis > 1)."""

    @property
    def profile(self) -> DeviceProfile:
        """The devices' profile."""
        return self.cluster.profile

    @functools.cached_property
    def dp(self) -> int:
        """Data-parallel replicas (read many times per estimate: kept)."""
        return self.plan.data_parallel_size

    @property
    def t(self) -> int:
        """The tensor axis's size."""
        return self.sizes.get("tensor", 1)

    @property
    def stages(self) -> int:
        """Pipeline stages."""
        return self.sizes.get("stage", 1)

    @property
    def k(self) -> int:
        """Microbatches per step."""
        return self.plan.num_microbatches

    @property
    def expert(self) -> int:
        """The expert axis's size: the devices a mixture-of-experts layer's routed experts are split over."""
        return self.sizes.get("expert", 1)

    @property
    def experts(self) -> ExpertWork:
        """The workload's mixture-of-experts work (zeros for a dense model)."""
        return self.work.experts()

    @property
    def context(self) -> int:
        """The context axis's size: the devices each sequence is split over."""
        return self.sizes.get("context", 1)

    @property
    def b_local(self) -> float:
        """Examples' worth of tokens per device per step: the data-parallel replica's examples, each split over the
        context axis (attention's causal work is balanced over it, so it divides like the rest)."""
        return self.work.global_batch / self.dp / self.context

    @property
    def sequence(self) -> bool:
        """Whether the activations between blocks are split along the sequence over the tensor axis."""
        return self.plan.sequence_parallel and self.t > 1

    def local_bytes(self, x: Any, spec: P) -> int:
        """Bytes of leaf ``x`` on one device under ``spec`` (memoised: a search prices the same leaves many times)."""
        return _block_bytes(tuple(x.shape), x.dtype.itemsize, spec, self.sizes_key)

    @property
    def loss_end_share(self) -> float:
        """Of the loss's two fp32 output-sized copies, the share held at the forward's end: 1, or where the compiler
        keeps one as the head's product in the compute dtype (`CompilerMemory.loss_copy_in_compute_dtype`),
        ``(1 + compute / output itemsize) / 2``."""
        if not self.profile.memory.loss_copy_in_compute_dtype:
            return 1.0
        out = max((v.aval.dtype.itemsize for v in self.work.outputs), default=4)
        return (1 + min(self.mp.compute_dtype.itemsize / out, 1.0)) / 2

    def stacked(self, names: Any) -> bool:
        """Whether a leaf with logical axis ``names`` is stacked over a scanned ``"layers"`` axis."""
        return bool(names) and names[0] == LAYER_AXIS


def _layout(
    plan: ShardingPlan,
    work: Workload,
    tx: Optimizer,
    profile: DeviceProfile | Cluster,
    base_specs: Any | None,
    sharded_specs: Any | None,
    imbalance: float = EXPERT_IMBALANCE,
) -> _Layout:
    sizes = {a: int(n) for a, n in plan.mesh_shape.items()}
    cluster = profile if isinstance(profile, Cluster) else Cluster(profile, 1, math.prod(sizes.values()))
    mp = precision(plan.precision)
    cluster = _attention_as_run(cluster, mp.compute_dtype.itemsize <= 2)  # the kernel this device runs
    params = work.memo(("params", plan.precision), lambda: jax.tree.leaves(mp.cast_to_param(work.params)))
    policy = work.policy_activations(plan.remat, plan.precision)
    if policy is None:
        raise PlanningError(
            f"remat={plan.remat!r} precision={plan.precision!r} cannot be priced: the model's step does not call a "
            "library apply function, so the policies would not apply; plan with remat='none' and precision='fp32'"
        )
    p_specs, g_specs = _specs(plan.param_specs), _specs(plan.grad_specs)
    base = _specs(base_specs) if base_specs is not None else g_specs
    sharded = _specs(sharded_specs) if sharded_specs is not None else g_specs
    opt = work.memo(("opt", id(tx)), lambda: jax.tree.leaves(work.opt_state(tx)))
    o_specs = _specs(plan.opt_specs)
    names = work.memo(("names",), lambda: logical_names(work.params))
    sizes_key = tuple(sorted(sizes.items()))
    return _Layout(
        plan,
        work,
        cluster,
        sizes,
        sizes_key,
        mp,
        policy,
        params,
        opt,
        p_specs,
        g_specs,
        base,
        sharded,
        o_specs,
        names,
        imbalance,
    )


_PLAIN: dict[tuple[int, bool], tuple[Cluster, Cluster]] = {}


def _attention_as_run(cluster: Cluster, half: bool) -> Cluster:
    """``cluster`` whose stack runs attention as it does on its devices in half precision (``half``) or not
    (`Stack.on`: a kernel where it runs, else plain fused XLA ops), made once for the last few clusters (held, so
    their ids stay theirs): its collective prices are remembered (`Cluster.collective_seconds`) across a search's
    estimates."""
    key = (id(cluster), half)
    held = _PLAIN.get(key)
    if held is None or held[0] is not cluster:
        if len(_PLAIN) >= 64:
            del _PLAIN[next(iter(_PLAIN))]
        stack = cluster.stack.on(cluster.profile.name, half)
        held = _PLAIN[key] = (cluster, cluster if stack == cluster.stack else dataclasses.replace(cluster, stack=stack))
    return held[1]


class _Activations(NamedTuple):
    """The activations per example after the tensor (and sequence) split, and what the policies keep of them."""

    split: float
    """Every activation, after the tensor / sequence split (what the step writes and reads)."""
    kept: float
    """The remat and precision policies' share of ``split``: what is saved for the backward."""
    split_share: float
    """Fraction of the matmul FLOPs computed split over the tensor axis."""
    resharded: float
    """Bytes per example whose split the ops cannot carry (gathered forward, reduce-scattered backward)."""
    cuts: int
    """Reshapes that cut the tensor-split dim unevenly."""
    checkpointed: float = 0.0
    """Of ``kept``, what the policy keeps through the whole backward (the checkpointed values and the loss's); the
    rest is one block's recomputed residuals, alive only while that block's backward runs."""
    loss: float = 0.0
    """Of ``checkpointed``, the loss's two output-sized copies (alive at the forward's end, one of them, the
    outputs' cotangent, at the backward's start)."""


def _activations(lay: _Layout) -> _Activations:
    work = lay.work
    act_per_example, split_share, reshard, cuts, loss = work.tensor_split(
        tuple(axis_dim(bs, "tensor") for bs in lay.base), lay.t, lay.sequence
    )
    split_act = act_per_example  # every activation, after the tensor / sequence split
    policy = lay.policy
    if work.activation_bytes_per_example:  # the policy's share of the (tensor-split) activations
        act_per_example *= policy.bytes_per_example / work.activation_bytes_per_example
    through = policy.checkpointed_per_example
    whole = through is None or not policy.bytes_per_example
    checkpointed = act_per_example if whole else act_per_example * through / policy.bytes_per_example
    peer = peer_saved_parts(lay, lay.plan.remat)  # a peer stack keeps what its own recipe does
    if peer is not None:
        act_per_example, remade, loss = peer
        checkpointed = act_per_example - remade
    return _Activations(split_act, act_per_example, split_share, reshard, cuts, checkpointed, min(loss, checkpointed))


def peer_saved_parts(lay: _Layout, remat: str) -> tuple[float, float, float] | None:
    """(the activation bytes per example a peer stack keeps under ``remat`` by its published recipe, of them one
    layer's re-made residuals, of them the loss's logits) on one device of the plan's tensor split
    (`openhosti_jax.planner.recipes.saved_parts`, `Stack.saves`); None where the trace prices them (this library's
    stack, a policy the stack has no recipe for, a model without a transformer layer scan)."""
    itemsize = lay.mp.compute_dtype.itemsize
    return saved_parts(lay.cluster.stack, lay.work, remat, itemsize, lay.t, lay.sequence)


class _Memory(NamedTuple):
    """Bytes per device, and what fitting them costs in FLOPs."""

    parts: dict[str, float]
    """state, batch, temporaries, total."""
    flops_factor: float
    """The remat policy's FLOPs factor, raised where the stack's compiler recomputes activations to fit."""
    opt_local: float
    """Optimizer state bytes on one device (the update streams them)."""


def _memory(lay: _Layout, acts: _Activations) -> _Memory:
    """The state (parameters and optimizer state as sharded, over the pipeline stages), the local batch and the
    larger of the step's two temporary peaks."""
    params, stages = lay.params, lay.stages
    param_local = sum(lay.local_bytes(x, s) for x, s in zip(params, lay.p_specs, strict=True))
    opt_local = sum(lay.local_bytes(x, s) for x, s in zip(lay.opt, lay.o_specs, strict=True)) / _context_shards(lay)
    grad_full = [lay.local_bytes(x, bs) for x, bs in zip(params, lay.base, strict=True)]
    grads = _gradients(lay, grad_full)
    act = acts.kept * lay.b_local / lay.k
    if stages > 1:  # 1F1B: at most S microbatches in flight at the first stage, each holding that stage's share
        act = acts.kept * (lay.b_local / lay.k) * min(lay.k, stages)
    accumulator = sum(lay.local_bytes(x, s) for x, s in zip(params, lay.g_specs, strict=True)) if lay.k > 1 else 0.0
    batch = tree_bytes(lay.work.batch) / lay.dp / lay.context
    state = (param_local + opt_local) / stages
    reduction = grads.stacked_out + grads.scattered + _reduction_bytes(lay, grads)
    # a compute dtype other than the parameters' makes a cast copy of the (local) parameters for the step
    mp = lay.mp
    cast = (
        param_local * mp.compute_dtype.itemsize / mp.param_dtype.itemsize if mp.compute_dtype != mp.param_dtype else 0.0
    )

    # what the loss holds, and what the blocks keep through the whole backward, for one microbatch
    share = act / acts.kept if acts.kept else 0.0
    loss, through = acts.loss * share, acts.checkpointed * share

    def temporaries(act: float) -> float:  # the step's peak above the state, per pipeline stage
        kept = min(through, act) - loss  # the blocks' checkpointed values (remat "none": every residual)
        block = act - loss - kept  # one block's recomputed residuals, while its backward runs
        if not lay.profile.memory.phase_peaks:  # the loss's copies and a block's residuals live into every phase
            loop = act + grads.stacked_out + grads.loop + grads.held
            return (max(act + grads.start, loop, reduction) + accumulator + cast) / stages
        at_end = loss * lay.loss_end_share  # the loss's copies at the forward's end, as the compiler keeps them
        peak = max(
            kept + at_end + grads.head,  # the forward's end: the loss's two copies, the output head gathered
            kept + loss / 2 + grads.start,  # the backward's start: the outputs' cotangent, the head's gradient
            kept + block + grads.stacked_out + grads.loop + grads.held,  # the layers' backward loop
            reduction,
        )
        return (peak + accumulator + cast) / stages

    temp = temporaries(act)
    over = state + batch + temp - (lay.profile.memory_bytes or math.inf)
    drop, factor = _compiler_recompute(lay, act, over)
    if drop > 0:
        temp = temporaries(act - drop)
    return _Memory(
        {"state": state, "batch": batch, "temporaries": temp, "total": state + batch + temp}, factor, opt_local
    )


def _context_shards(lay: _Layout) -> int:
    """How many ways a peer stack splits the optimizer state over the ``context`` axis beyond the plan's specs
    (`Stack.optimizer_over_context`: Megatron-Core, torchtitan, MaxText shard it there too); 1 for this library."""
    if not lay.cluster.stack.optimizer_over_context or lay.context <= 1:
        return 1
    return 1 if any("context" in spec_axes(s) for s in lay.o_specs) else lay.context


class _Gradients(NamedTuple):
    """What the step holds of the gradients and ZeRO-3's gathered copies at each of its peaks.

    A leaf stacked over a scanned ``"layers"`` axis is used a layer at a time: the backward's loop gathers its
    layer (ZeRO-3, per use, the next leaf prefetched) and reduces its layer's gradient there (the loop's stacked
    output cannot hold an unreduced sum), so its gradient output is held whole in its reduced layout for the whole
    backward, and one layer's unreduced gradient leaf is in flight. Every other leaf is gathered for its use and
    reduced after the backward by one combined collective; the backward starts on the largest of them (the output
    head), its gathered copy and its gradient live together. Remat ``"none"`` keeps every residual, so the
    gathered copies of every leaf and layer (the matmuls' operands, in the compute dtype) stay from the forward
    to the backward."""

    stacked_out: float
    """The stacked leaves' gradient outputs in their reduced layout (ZeRO-2/3: sharded)."""
    start: float
    """At the backward's start, besides the activations: the largest unstacked leaf's gathered copy (ZeRO-3) and
    its full gradient."""
    loop: float
    """In the layers' loop, besides the activations and ``stacked_out``: the gathered layer leaf and the next one,
    and one layer's unreduced gradient leaf."""
    combined: float
    """The full gradients of the unstacked leaves that the combined reduction after the backward takes (a ZeRO-3
    leaf's gradient is reduce-scattered where it is made instead: the transpose of its gather)."""
    combined_out: float
    """``combined`` in its reduced layout."""
    scattered: float
    """The reduce-scattered gradients of the unstacked ZeRO-3 leaves, held from the backward on."""
    held: float = 0.0
    """In the layers' loop: the full gradient of the largest unstacked leaf the combined reduction takes after the
    backward (the output head's, made at the backward's start and held to the end)."""
    head: float = 0.0
    """At the forward's end, besides the activations: the largest unstacked leaf's gathered copy (ZeRO-3; remat
    ``"none"`` keeps every leaf's where the stack's compiler holds them, `CompilerMemory.keeps_gathered_weights`)."""


def _gradients(lay: _Layout, grad_full: list[int]) -> _Gradients:
    if lay.stages > 1:
        return _pipelined_gradients(lay, grad_full)
    mp = lay.mp
    cast = mp.compute_dtype.itemsize / mp.param_dtype.itemsize if mp.compute_dtype != mp.param_dtype else 0.0
    stacked_out, flat, combined, combined_out, scattered, held = 0.0, [], 0.0, 0.0, 0.0, 0.0
    flat_gathered, layer_leaf, layer_gathered = 0.0, 0.0, 0.0
    kept_flat, kept_layers = 0.0, 0.0  # what remat "none" keeps of the gathered copies
    used = cast or 1.0  # a gathered copy is in the compute dtype: the parameters are cast before they are gathered
    # the full gradient of the (cast) copy a step computes with: in the compute dtype until it is reduced
    made = used if lay.profile.memory.gradients_in_compute_dtype else 1.0
    for g, x, ps, bs, gs, names in zip(
        grad_full, lay.params, lay.p_specs, lay.base, lay.g_specs, lay.names, strict=True
    ):
        gathered = spec_axes(ps) != spec_axes(bs)  # ZeRO-3 shards it: gathered whole for its use
        g_used, g = g * used, g * made
        if lay.stacked(names):
            stacked_out += lay.local_bytes(x, gs)
            layer_leaf = max(layer_leaf, g / x.shape[0])
            layer_gathered = max(layer_gathered, 2 * g_used / x.shape[0] if gathered else 0.0)
            # a scanned layer's cast copy is a residual of the loop; uncast, it is gathered again
            kept_layers += g_used * (cast > 0) if gathered else 0.0
            continue
        flat.append(g)
        flat_gathered = max(flat_gathered, g_used if gathered else 0.0)
        kept_flat += g_used if gathered else 0.0  # one gather serves the forward and the backward
        if gathered and lay.profile.native_reduce_scatter:
            scattered += lay.local_bytes(x, gs)
        else:  # without a native reduce-scatter (XLA:CPU) a ZeRO-3 leaf's gradient is all-reduced whole, then sliced
            combined += g
            combined_out += lay.local_bytes(x, gs)
            held = max(held, g)
    if (
        lay.plan.remat == "none" and lay.profile.memory.keeps_gathered_weights
    ):  # the gathered weights stay to the backward
        flat_gathered, layer_gathered = kept_flat, kept_layers
    start = flat_gathered + max(flat, default=0)
    loop = layer_gathered + layer_leaf
    return _Gradients(stacked_out, start, loop, combined, combined_out, scattered, held, flat_gathered)


def _pipelined_gradients(lay: _Layout, grad_full: list[int]) -> _Gradients:
    """The pipeline executor's: a stage's parameters packed into one buffer per chunk, the gradient of the whole
    schedule accumulated in it and reduced once after it (one combined collective), ZeRO-3's gathered copies of
    a stage's leaves held through its schedule (a stacked leaf's a layer at a time, the next prefetched)."""
    gathered = sum(
        g * (min(2 / x.shape[0], 1.0) if lay.stacked(names) else 1.0)
        for g, x, ps, bs, names in zip(grad_full, lay.params, lay.p_specs, lay.base, lay.names, strict=True)
        if spec_axes(ps) != spec_axes(bs)
    )
    combined_out = sum(lay.local_bytes(x, s) for x, s in zip(lay.params, lay.g_specs, strict=True))
    return _Gradients(0.0, gathered + max(grad_full, default=0), 0.0, float(sum(grad_full)), combined_out, 0.0)


def _reduction_bytes(lay: _Layout, grads: _Gradients) -> float:
    """The combined gradient reduction's peak: one collective whose full input and output are both live (a native
    reduce-scatter's output is the sharded gradient)."""
    if lay.dp == 1:
        return grads.combined
    if lay.plan.zero_stage >= 2 and lay.profile.native_reduce_scatter:
        return grads.combined + grads.combined_out
    return 2 * grads.combined  # all-reduced (on CPU also under ZeRO-2: an all-reduce and a slice)


def _compiler_recompute(lay: _Layout, act: float, over: float) -> tuple[float, float]:
    """(activation bytes the stack's compiler drops to fit when the step is ``over`` the device's memory, the FLOPs
    factor with their recomputation): the compiler recomputes the overflow, that share of the way to the full
    recomputation of remat "full"."""
    plan, policy = lay.plan, lay.policy
    factor = policy.flops_factor
    if lay.cluster.stack.compiler_remat and over > 0 and plan.remat not in ("full", "offload"):
        full = lay.work.policy_activations("full", plan.precision)
        kept = full.bytes_per_example / policy.bytes_per_example if full else 1.0
        peer, peer_full = peer_saved_parts(lay, plan.remat), peer_saved_parts(lay, "full")
        if full and peer and peer[0] and peer_full is not None:  # the stack's own recipes, as its activations are
            kept = peer_full[0] / peer[0]  # priced
        droppable = act * (1 - kept)
        if droppable > 0:
            drop = min(over * lay.stages, droppable)
            return drop, factor + drop / droppable * (full.flops_factor - policy.flops_factor)
    return 0.0, factor


class _Collectives:
    """The step's collectives, each priced as it is added: seconds by what they move (``"gather"``: ZeRO-3's
    parameter gathers, ``"grad"``: gradient reductions, ``"tensor"``: tensor-parallel activations, ``"expert"``: a
    mixture of experts' token all-to-alls) and the bytes
    each device sends."""

    def __init__(self, lay: _Layout) -> None:
        self.lay = lay
        self.seconds = {"gather": 0.0, "grad": 0.0, "tensor": 0.0, "expert": 0.0}
        self.bus_bytes = 0.0
        self._gradients: dict[tuple[str, tuple[str, ...]], float] = {}
        self._log: list[tuple[str, float, float]] | None = None

    def add(self, kind: str, nbytes: float, axes: tuple[str, ...], messages: float = 1.0, what: str = "gather") -> None:
        """``nbytes`` (the replica's, of which a stage moves its share) over ``axes`` in ``messages`` equal
        collectives, each priced at its own message size."""
        sizes, stages = self.lay.sizes, self.lay.stages
        n = math.prod(sizes.get(a, 1) for a in axes)
        nbytes /= stages  # every collective is per layer: a stage's devices move their layers' share
        if n > 1 and nbytes > 0:
            count = max(messages / stages, 1.0)
            seconds = count * self.lay.cluster.collective_seconds(kind, nbytes / count, sizes, axes)
            sent = bus_bytes(kind, nbytes, n)
            self.seconds[what] += seconds
            self.bus_bytes += sent
            if self._log is not None:
                self._log.append((what, seconds, sent))

    def reduce_gradient(self, kind: str, nbytes: float, axes: tuple[str, ...]) -> None:
        """A gradient reduction, combined with the others of its kind and group (XLA's combiners fuse them)."""
        if math.prod(self.lay.sizes.get(a, 1) for a in axes) > 1 and nbytes > 0:
            self._gradients[(kind, axes)] = self._gradients.get((kind, axes), 0.0) + nbytes

    def add_gradient_reductions(self) -> None:
        """Price the combined gradient reductions, one message per kind and group."""
        for (kind, axes), size in self._gradients.items():
            self.add(kind, size, axes, what="grad")

    def replay(self, part: tuple, reads: tuple, add: Any) -> Any:
        """``add()``'s result, its collectives added as ``add`` adds them, priced once per ``part`` (hashable values)
        and the objects it ``reads`` (held with the prices, so their ids stay theirs) on this cluster's devices: a
        search prices the same parameter collectives for every remat policy and microbatch count of a family, and
        the same tensor-parallel ones for every ZeRO stage of a mesh. The seconds and bytes are summed in the order
        ``add`` sums them (the same floating-point result)."""
        lay = self.lay
        reads = (lay.profile, *reads)
        store = lay.work.memo(("collectives",), dict)
        key = (*part, lay.cluster.hosts, lay.cluster.devices_per_host, lay.sizes_key, *map(id, reads))
        held = store.get(key)
        if held is None or any(a is not b for a, b in zip(held[0], reads, strict=True)):
            self._log = []
            result = add()
            held = store[key] = (reads, self._log, result)
            self._log = None
            return result
        for what, seconds, sent in held[1]:
            self.seconds[what] += seconds
            self.bus_bytes += sent
        return held[2]


def _communication(lay: _Layout, acts: _Activations) -> tuple[_Collectives, float]:
    """(the step's collectives, the parameter bytes each device updates)."""
    comm = _Collectives(lay)

    def parameters() -> float:
        updated = _parameter_collectives(lay, comm)
        comm.add_gradient_reductions()
        return updated

    reads, spec = (lay.params, lay.base, lay.names), lay.plan.batch_spec
    updated = comm.replay(("parameters", lay.plan.zero_stage, spec), (*reads, lay.sharded), parameters)
    if lay.t > 1:
        comm.replay(("tensor", lay.k, lay.sequence, spec), reads, lambda: _tensor_collectives(lay, acts, comm))
    if lay.context > 1:
        _context_collectives(lay, comm)
    if lay.expert > 1:
        _expert_collectives(lay, comm)
    return comm, updated


def expert_all_to_all_bytes(work: Workload, examples: float, itemsize: int) -> tuple[float, float]:
    """(bytes each device's buffers hold over one step's token all-to-alls, all-to-alls) for ``examples`` examples
    per device: per MoE layer, the dispatch of every token's ``top_k`` rows to their experts' devices and their
    return (combine), forward and backward (the cotangents go the same ways back): four all-to-alls of ``tokens x
    top_k x d_model x itemsize`` bytes per layer; each device sends ``(n - 1) / n`` of them over an ``expert`` axis
    of ``n`` (`bus_bytes`)."""
    e = work.experts()
    return 4 * examples * e.rows_per_example * e.width * itemsize, 4 * e.layers


def expert_exchange_padding(work: Workload, expert: int, shards: int, stack: Stack) -> float:
    """The bytes an expert-parallel layer's token exchange moves over the rows it routes, on ``stack``
    (`Stack.padded_expert_exchange`) with an ``expert`` axis of that size and the tokens over ``shards`` devices:
    1 where only the routed rows move; ``expert`` for a padded dropless exchange (a row per assignment to every
    device); for a padded capacity one ``min(shards, experts / (capacity_factor x top_k))``: each expert gets a slot
    for every local token up to the call's capacity, ``capacity_factor x top_k / experts`` of the call's tokens.

    >>> from openhosti_jax.models.presets import model_preset
    >>> from openhosti_jax.planner.stacks import STACKS
    >>> from openhosti_jax.planner.workload import workload
    >>> p = model_preset("mixtral-8x7b", n_layers=1, seq_len=64)
    >>> work = workload(p.init, p.sample_batch(1))
    >>> [expert_exchange_padding(work, 8, 64, STACKS[s]) for s in ("openhosti", "megatron-core")]
    [8.0, 1.0]
    >>> p = model_preset("mixtral-8x7b", n_layers=1, seq_len=64, capacity_factor=1.25)
    >>> expert_exchange_padding(workload(p.init, p.sample_batch(1)), 8, 64, STACKS["openhosti"])  # 8 / (1.25 x 2)
    3.2
    """
    e = work.experts()
    if not stack.padded_expert_exchange or expert <= 1 or not e.rows_per_example:
        return 1.0
    if e.grouped:
        return float(expert)
    slots_per_token = e.rows_per_example / e.layers / max(work.tokens_per_example, 1)  # capacity_factor x top_k
    return max(1.0, min(float(shards), e.num_experts / slots_per_token))


def _expert_collectives(lay: _Layout, comm: _Collectives) -> None:
    """Add the token all-to-alls of the mixture-of-experts layers to ``comm``, per microbatch and layer (the
    forward's pair again where remat recomputes the block in the backward, and again where a pipeline's backward
    recomputes its chunk's forward; a stage's devices move their layers' share, `_Collectives.add`), padded as
    the stack's exchange is (`expert_exchange_padding`)."""
    nbytes, count = expert_all_to_all_bytes(lay.work, lay.b_local, lay.mp.compute_dtype.itemsize)
    if not count:
        return
    pairs = 2 + (lay.plan.remat != "none") + (lay.stages > 1)  # forward, backward, recomputed forwards
    padding = expert_exchange_padding(lay.work, lay.expert, lay.dp, lay.cluster.stack)
    nbytes, count = nbytes * pairs / 2 * padding, count * pairs / 2
    comm.add("all_to_all", nbytes, ("expert",), lay.k * count, what="expert")


def kv_width(work: Workload) -> tuple[int, int]:
    """(key and value elements per token of one attention layer, the attention layers): the output widths of the
    leaves whose last dim is named ``"kv_heads"`` (grouped-query attention), else twice the widest ``"heads"`` one
    (multi-head); (0, 0) where no leaf is named so: such a model's attention cannot be priced over a context axis.

    >>> from openhosti_jax.models.presets import model_preset
    >>> from openhosti_jax.planner.workload import workload
    >>> p = model_preset("llama3-8b", n_layers=2, seq_len=256)
    >>> kv_width(workload(p.init, p.sample_batch(1)))  # k and v: 8 heads of 128 each, two layers
    (2048, 2)
    """

    def walk() -> tuple[int, int]:
        kv, heads = 0, 0
        names = work.memo(("names",), lambda: logical_names(work.params))  # as `_layout` reads them
        for x, leaf_names in zip(jax.tree.leaves(work.params), names, strict=True):
            if leaf_names and leaf_names[-1] == "kv_heads":
                kv += int(x.shape[-1])
            elif leaf_names and leaf_names[-1] == "heads":
                heads = max(heads, int(x.shape[-1]))
        width = kv or 2 * heads
        return (width, work.layer_count or 1) if width else (0, 0)

    return work.memo(("kv_width",), walk)


def _context_collectives(lay: _Layout, comm: _Collectives) -> None:
    """Add the context axis's key/value exchange to ``comm``: per microbatch and attention layer, every device
    gathers the sequence's keys and values (the forward, and again for the backward's recomputation or reuse),
    and the backward reduce-scatters their gradients back to their shards."""
    width, layers = kv_width(lay.work)
    if not width:
        raise PlanningError(
            "a context axis needs the attention's key/value width, which the model does not name: expected leaves "
            "whose last logical dim is 'kv_heads' or 'heads' (nnx metadata out_sharding=(...)); found none. Name "
            "the attention projections, or plan without a context axis"
        )
    k = lay.k
    gathered = lay.b_local * lay.context * lay.work.tokens_per_example * width * lay.work.activation_itemsize
    nbytes = layers * gathered / (lay.t if lay.t > 1 and width % lay.t == 0 else 1)  # heads split over tensor
    comm.add("all_gather", 2 * nbytes, ("context",), 2 * k * layers, what="tensor")
    comm.add("reduce_scatter", nbytes, ("context",), k * layers, what="tensor")


def _parameter_collectives(lay: _Layout, comm: _Collectives) -> float:
    """Add each parameter leaf's gradient reduction and ZeRO-3 gather to ``comm``; the parameter bytes each device
    updates."""
    plan, sizes = lay.plan, lay.sizes
    native = plan.zero_stage >= 2 and lay.profile.native_reduce_scatter
    dp_axes = tuple(spec_axes(plan.batch_spec))
    updated = 0.0
    for x, zs, bs, names in zip(lay.params, lay.sharded, lay.base, lay.names, strict=True):
        full = lay.local_bytes(x, bs)
        z = _group(zs, bs) if plan.zero_stage >= 1 else ()
        if native:
            comm.reduce_gradient("reduce_scatter", full, z)
            comm.reduce_gradient(  # an expert leaf split over ``expert`` is reduced over the other axes only
                "all_reduce",
                full / math.prod(sizes[a] for a in z),
                tuple(a for a in dp_axes if a not in z and a not in spec_axes(bs)),
            )
        else:
            comm.reduce_gradient("all_reduce", full, tuple(a for a in dp_axes if a not in spec_axes(bs)))
        comm.add("all_gather", full, z, int(x.shape[0]) if lay.stacked(names) else 1)  # a layer at a time
        updated += full / math.prod(sizes[a] for a in z)
    return updated


def _tensor_collectives(lay: _Layout, acts: _Activations, comm: _Collectives) -> None:
    """Add the tensor-parallel activation collectives to ``comm``: per microbatch and layer, an all-reduce of each
    tensor-split matmul's activation (under sequence parallelism a reduce-scatter into the sequence split and an
    all-gather out of it), and the values whose split the ops cannot carry, gathered forward and reduce-scattered
    backward."""
    k, b_local = lay.k, lay.b_local
    tokens = b_local * lay.work.tokens_per_example
    for x, bs, names in zip(lay.params, lay.base, lay.names, strict=True):
        width, layers = _tensor_activation_width(tuple(x.shape), bs, lay.stacked(names))
        if width and lay.sequence:  # a reduce-scatter into the sequence split, an all-gather out of it
            nbytes = layers * tokens * width * lay.work.activation_itemsize
            comm.add("reduce_scatter", nbytes, ("tensor",), k * layers, what="tensor")
            comm.add("all_gather", nbytes, ("tensor",), k * layers, what="tensor")
        elif width:  # per microbatch and layer
            nbytes = layers * tokens * width * lay.work.activation_itemsize
            comm.add("all_reduce", nbytes, ("tensor",), k * layers, what="tensor")
    comm.add("all_gather", acts.resharded * b_local, ("tensor",), k, what="tensor")
    comm.add("reduce_scatter", acts.resharded * b_local, ("tensor",), k, what="tensor")


def fp8_rate(profile: DeviceProfile) -> float:
    """The FLOP/s precision ``"fp8"``'s matmuls run at: the profile's ``fp8_flops``, else (CPU, emulated) its bf16
    peak."""
    return profile.fp8_flops or profile.peak_flops


def _compute_seconds(lay: _Layout, acts: _Activations, flops: float, aw: AttentionWork | None) -> float:
    """Seconds of the step's matmul FLOPs on one device, each matmul at the efficiency of its size; attention's at
    the stack's kernel rate, its masked half skipped by a flash kernel, where the stack prices it apart. Under
    precision ``"fp8"`` the other matmuls (the output head's too, which runs in bf16: a few percent of a large
    model's) at the profile's fp8 rate (`fp8_rate`), attention at the bf16 peak."""
    stack, peak = lay.cluster.stack, lay.profile.peak_flops
    rate = fp8_rate(lay.profile) if lay.mp.fp8_matmuls else peak  # the projections' (attention stays bf16)
    eff = functools.partial(
        matmul_efficiency, lay.work, lay.profile, lay.b_local / lay.k, lay.t, acts.split_share, expert=lay.expert
    )
    if lay.expert > 1:  # the slowest device's experts take imbalance x the balanced share of the routed work
        flops *= 1 + lay.experts.share * (lay.imbalance - 1)
    if aw is not None and aw.attention_share and (stack.causal_skip or stack.attention_efficiency is not None):
        # attention's matmuls at the kernel's own rate, the masked half skipped by a flash kernel
        att = flops * aw.attention_share * (0.5 if stack.causal_skip and aw.masked else 1.0)
        att_s = att / (peak * (stack.attention_efficiency or eff(True)))
        return flops * (1 - aw.attention_share) / (rate * eff(False)) + att_s
    if aw is not None and aw.attention_share and rate != peak:
        return flops * (1 - aw.attention_share) / (rate * eff()) + flops * aw.attention_share / (peak * eff())
    return flops / (rate * eff())


def _memory_traffic(
    lay: _Layout, acts: _Activations, mem: _Memory, aw: AttentionWork | None, split: float, updated: float
) -> float:
    """Bytes the step streams through device memory: every activation written in the forward and read in the
    backward (the recomputed ones once more), the update's parameters and optimizer state, and under an eager
    stack every elementwise op's inputs and outputs and attention scores written apart."""
    stack, b_local, factor = lay.cluster.stack, lay.b_local, mem.flops_factor
    act_traffic = 2 * acts.split * b_local * factor
    mem_bytes = act_traffic + 2 * updated + updated + 2 * mem.opt_local
    if stack.fused or aw is None:  # the dispatch's gathers and sorts, forward and (twice) backward, as elementwise
        mem_bytes += 3 * lay.experts.dispatch_bytes * b_local * factor  # (eager: already in elementwise_bytes)
    if aw is not None and not stack.fused:  # eager: every elementwise op reads and writes device memory, the
        # backward about twice the forward (the output's gradient and the saved inputs read, the input's written)
        scale = lay.mp.compute_dtype.itemsize / lay.work.activation_itemsize
        mem_bytes += 3 * aw.elementwise_bytes * scale * b_local * split * factor - act_traffic
    if aw is not None and not stack.flash_attention:  # scores written and read by separate kernels
        again = stack.score_bytes_forward if lay.plan.remat != "none" else 0.0  # recomputed with the block
        mem_bytes += aw.score_elements * b_local / lay.t * (stack.score_bytes + again)
    return mem_bytes


def _matmul_work(lay: _Layout, acts: _Activations, factor: float) -> tuple[float, float, AttentionWork | None]:
    """(the share of a replica's per-example work one device does, the step's matmul FLOPs on one device with the
    FLOPs factor ``factor``, the attention work where the stack prices it apart)."""
    stack = lay.cluster.stack
    split = 1 - acts.split_share + acts.split_share / lay.t
    flops = lay.work.flops_per_example * lay.b_local * split * factor
    if lay.stages > 1:  # the pipeline's backward recomputes its chunk's forward from the stored input
        flops *= 4 / 3
    priced_apart = stack.causal_skip or stack.attention_efficiency is not None or not stack.fused
    aw = lay.work.attention_work() if priced_apart or not stack.flash_attention else None
    return split, flops, aw


def matmul_seconds(
    plan: ShardingPlan,
    work: Workload,
    tx: Optimizer,
    profile: DeviceProfile | Cluster,
    base_specs: Any | None = None,
    sharded_specs: Any | None = None,
) -> float:
    """The per-device seconds of ``plan``'s matmuls at FLOPs factor 1: `estimate`'s ``time["compute"]`` over its
    ``flops_factor`` (up to rounding), without pricing the rest. The step of the same mesh shape and precision
    with any ZeRO stage, remat policy and at least as many microbatches takes at least this times its FLOPs
    factor (`openhosti_jax.planner.prune`): it adds memory, the bubble and collectives to its matmuls, which
    scale with the factor, and a smaller microbatch's matmuls run no faster (`DeviceProfile.matmul_curve` is
    non-decreasing in size)."""
    lay = _layout(plan, work, tx, profile, base_specs, sharded_specs)
    acts = _activations(lay)
    _, flops, aw = _matmul_work(lay, acts, 1.0)
    return _compute_seconds(lay, acts, flops, aw) / lay.stages


def bubble_factor(stages: int, microbatches: int, virtual: int = 1) -> float:
    """A pipeline stage's step time over its work: 1 plus its idle ticks, ``(S - 1) / (V max(M, S))`` for S
    ``stages`` of V ``virtual`` (interleaved) chunks each and M ``microbatches`` (Narayanan et al. 2021: interleaving
    divides the fill and drain by V); 1 without a pipeline.

    >>> bubble_factor(4, 16), bubble_factor(4, 16, virtual=3), bubble_factor(1, 8)
    (1.1875, 1.0625, 1.0)
    """
    if stages <= 1:
        return 1.0
    return 1.0 + (stages - 1) / (virtual * max(microbatches, stages))


def _step_time(lay: _Layout, acts: _Activations, mem: _Memory, comm: _Collectives, updated: float) -> dict[str, float]:
    """Seconds per step by part, per device: a stage does 1/S of its replica's work and waits in the bubble; the
    collectives hide under the work where the compiler overlaps them, except those the stack cannot overlap."""
    plan, profile, stack, stages = lay.plan, lay.profile, lay.cluster.stack, lay.stages
    split, flops, aw = _matmul_work(lay, acts, mem.flops_factor)
    compute = _compute_seconds(lay, acts, flops, aw)
    mem_bytes = _memory_traffic(lay, acts, mem, aw, split, updated)
    offload = 2 * lay.policy.host_bytes_per_example * lay.b_local / profile.host_bandwidth  # to the host and back
    bandwidth = profile.memory_seconds(mem_bytes, mem.parts["total"])  # a small step streams from the caches
    virtual = plan.pipeline_virtual if plan.pipeline_schedule == "interleaved" else 1
    bubble = bubble_factor(stages, plan.num_microbatches, virtual)
    # each further microbatch is one more trip through the accumulation loop (a launch's fixed cost)
    launches = 1 if stages > 1 else lay.k  # a pipeline's microbatches are ticks of one program
    work_s = (compute + bandwidth + offload) / stages * bubble
    comm_s = sum(comm.seconds.values())
    # what the stack cannot overlap waits: a tensor-parallel all-reduce between two dependent matmuls (unless
    # the plan decomposes it into collective matmuls), a gradient reduction issued after the backward
    exposed = (
        (0.0 if stack.tensor_overlap or plan.collective_matmul else comm.seconds["tensor"])
        + (0.0 if stack.grad_overlap else comm.seconds["grad"])
        + comm.seconds["expert"]  # the experts wait for their tokens, the combine for the experts
    )
    hidden = max(work_s, comm_s - exposed) + exposed
    total = (hidden if profile.overlap else work_s + comm_s) + profile.launch_seconds * launches
    return {  # per device: a stage does 1/S of its replica's work, and waits in the bubble
        "compute": compute / stages,
        "memory": bandwidth / stages,
        "offload": offload / stages,
        "bubble": work_s - (compute + bandwidth + offload) / stages,
        "collectives": comm_s,
        "exposed": exposed if profile.overlap else comm_s,
        "launch": profile.launch_seconds,
        "total": total,
    }
