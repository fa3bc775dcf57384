"""The analytic cost model: per-device memory and per-step time of a `ShardingPlan` for a `Workload`.

Memory (bytes per device): parameters (in the precision policy's dtype) + optimizer state (with its fp32 master
copy) as sharded, the local batch, and the step's temporaries,
the larger of two peaks: the backward's start (every saved activation, the loss's included, the largest
gradient leaf, and under ZeRO-3 the gathered full copy of each sharded leaf; the activations are those the remat
and precision policies keep, from a trace under them, over the microbatch count) and the gradient reduction (XLA's
combiner makes it one collective whose full input and output are both live; a native reduce-scatter's output is
the sharded gradient). Time (seconds): matmul FLOPs (with the remat policy's recomputation) / (peak x the
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

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.planner.cost import estimate
    >>> from openhosti_jax.sharding.plan import ShardingPlan
    >>> from openhosti_jax.planner.profiles import PROFILES
    >>> from openhosti_jax.planner.workload import Workload
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
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PlanningError
from openhosti_jax.planner.cluster import Cluster
from openhosti_jax.planner.profiles import DeviceProfile, bus_bytes
from openhosti_jax.planner.workload import Workload
from openhosti_jax.policies.precision import precision
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.rules import LAYER_AXIS, logical_names
from openhosti_jax.sharding.specs import is_spec, local_shape, spec_axes
from openhosti_jax.sharding.zero import Optimizer
from openhosti_jax.sizes import tree_bytes


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


def _tensor_dim(spec: P) -> int | None:
    return next((d for d, entry in enumerate(spec) if entry is not None and "tensor" in spec_axes(P(entry))), None)


def _tensor_activation_width(shape: tuple[int, ...], spec: P, stacked: bool) -> tuple[int, int]:
    """(width of the activation a tensor-split weight's matmul all-reduces per token, layers it stands for); width 0
    when the weight is not tensor-split. A weight split on its first dim (row-parallel, vocab-parallel embedding)
    all-reduces its output (the last dim) forward; one split further in (column-parallel) all-reduces the gradient
    of its input (the first dim) backward. A scanned stack (``stacked``: a leading layers dim) counts per layer."""
    layers = shape[0] if stacked else 1
    dims, entries = (shape[1:], tuple(spec)[1:]) if stacked else (shape, tuple(spec))
    split = next((d for d, e in enumerate(entries) if e is not None and "tensor" in spec_axes(P(e))), None)
    if split is None or len(dims) < 2:
        return 0, layers
    return (dims[-1] if split == 0 else dims[0]), layers


def matmul_efficiency(
    work: Workload, profile: DeviceProfile, examples: float, t: int, split_share: float, batched: bool | None = None
) -> float:
    """The fraction of peak a step's matmuls reach together on one device: each matmul of the workload
    (`Workload.gemm_sizes`) at its size for ``examples`` examples per call (a microbatch), the tensor-split share of
    its FLOPs at ``1 / t`` of that, weighted by FLOPs (the step time of every matmul at its own
    `DeviceProfile.gemm_efficiency`, over the time at the peak); without a trace, the profile's large-GEMM
    efficiency. ``batched``: only the matmuls with (attention's) or without (the projections') batch dims.

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
    gemms = work.gemm_sizes(batched)
    if not gemms or not profile.matmul_curve:
        return profile.gemm_efficiency(math.inf)
    key = ("gemm efficiency", profile.matmul_curve, examples, t, split_share, batched)

    def weigh() -> float:
        eff, whole, split = profile.gemm_efficiency, 1 - split_share, split_share / t
        per_peak = sum(
            share * (whole / eff((mnk * examples) ** (1 / 3)) + split / eff((mnk * examples / t) ** (1 / 3)))
            for mnk, share in gemms
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
) -> Estimate:
    """Predicted memory and step time of ``plan`` for ``work`` on devices described by ``profile`` (one host of
    them) or on a `Cluster` (collectives priced in the hosts, then across them).

    ``base_specs`` are the specs before ZeRO (tensor parallel / annotations) and ``sharded_specs`` the fully
    ZeRO-sharded ones; they default to the plan's gradient specs (exact for stage 0 and for stage 3).
    """
    sizes = {a: int(n) for a, n in plan.mesh_shape.items()}
    cluster = profile if isinstance(profile, Cluster) else Cluster(profile, 1, math.prod(sizes.values()))
    profile = cluster.profile
    mp = precision(plan.precision)
    params = work.memo(("params", plan.precision), lambda: jax.tree.leaves(mp.cast_to_param(work.params)))
    sizes_key = tuple(sorted(sizes.items()))

    def local_bytes(x: Any, spec: P, _: Any) -> int:  # memoised: the search prices the same leaves many times
        return _block_bytes(tuple(x.shape), x.dtype.itemsize, spec, sizes_key)

    policy = work.policy_activations(plan.remat, plan.precision)
    if policy is None:
        raise PlanningError(
            f"remat={plan.remat!r} precision={plan.precision!r} cannot be priced: the model's step does not call a "
            "library apply function, so the policies would not apply; plan with remat='none' and precision='fp32'"
        )
    k = plan.num_microbatches
    p_specs, g_specs = _specs(plan.param_specs), _specs(plan.grad_specs)
    base = _specs(base_specs) if base_specs is not None else g_specs
    sharded = _specs(sharded_specs) if sharded_specs is not None else g_specs
    opt = work.memo(("opt", id(tx)), lambda: jax.tree.leaves(work.opt_state(tx)))
    o_specs = _specs(plan.opt_specs)
    dp, t = plan.data_parallel_size, sizes.get("tensor", 1)
    stages = sizes.get("stage", 1)
    b_local = work.global_batch / dp

    param_local = sum(local_bytes(x, s, sizes) for x, s in zip(params, p_specs, strict=True))
    opt_local = sum(local_bytes(x, s, sizes) for x, s in zip(opt, o_specs, strict=True))
    grad_full = [local_bytes(x, bs, sizes) for x, bs in zip(params, base, strict=True)]
    grads_full = sum(grad_full)
    # ZeRO-3 gathers a full copy of each sharded leaf for its use (the local shard stays in the arguments)
    # (a leaf stacked over a scanned "layers" axis is gathered a layer at a time, the next one prefetched)
    names_ = work.memo(("names",), lambda: logical_names(work.params))
    gathered = sum(
        g * (min(2 / x.shape[0], 1.0) if names and names[0] == LAYER_AXIS else 1.0)
        for g, ps, bs, x, names in zip(grad_full, p_specs, base, params, names_, strict=True)
        if spec_axes(ps) != spec_axes(bs)
    )
    sequence = plan.sequence_parallel and t > 1
    act_per_example, split_share, reshard, cuts = work.tensor_split(tuple(_tensor_dim(bs) for bs in base), t, sequence)
    split_act = act_per_example  # every activation, after the tensor / sequence split
    if work.activation_bytes_per_example:  # the policy's share of the (tensor-split) activations
        act_per_example *= policy.bytes_per_example / work.activation_bytes_per_example
    act = act_per_example * b_local / k
    if stages > 1:  # 1F1B: at most S microbatches in flight at the first stage, each holding that stage's share
        act = act_per_example * (b_local / k) * min(k, stages)
    accumulator = sum(local_bytes(x, s, sizes) for x, s in zip(params, g_specs, strict=True)) if k > 1 else 0.0
    batch = tree_bytes(work.batch) / dp
    state = (param_local + opt_local) / stages
    # Two peaks: the backward's start (every residual, the gathered parameters and the first, largest gradient
    # leaf) and the gradient reduction (one combined collective: its full input and its output both live).
    if dp == 1:
        reduction = grads_full
    elif plan.zero_stage >= 2 and profile.native_reduce_scatter:  # + the scattered output
        reduction = grads_full + sum(local_bytes(x, s, sizes) for x, s in zip(params, g_specs, strict=True))
    else:  # all-reduced (on CPU also under ZeRO-2/3: an all-reduce and a slice)
        reduction = 2 * grads_full
    # a compute dtype other than the parameters' makes a cast copy of the (local) parameters for the step
    cast = (
        param_local * mp.compute_dtype.itemsize / mp.param_dtype.itemsize if mp.compute_dtype != mp.param_dtype else 0.0
    )

    def temporaries(act: float) -> float:  # the backward's peak above the state, per pipeline stage
        return (max(act + gathered + max(grad_full, default=0), reduction) + accumulator + cast) / stages

    temp = temporaries(act)
    factor = policy.flops_factor
    over = state + batch + temp - (profile.memory_bytes or math.inf)
    if cluster.stack.compiler_remat and over > 0 and plan.remat not in ("full", "offload"):
        full = work.policy_activations("full", plan.precision)
        droppable = act * (1 - full.bytes_per_example / policy.bytes_per_example) if full else 0.0
        if droppable > 0:  # the compiler recomputes the overflow: that share of the way to full recomputation
            drop = min(over * stages, droppable)
            factor += drop / droppable * (full.flops_factor - policy.flops_factor)
            temp = temporaries(act - drop)
    memory = {"state": state, "batch": batch, "temporaries": temp, "total": state + batch + temp}
    # every activation is written in the forward and read in the backward, the recomputed ones once more
    act_traffic = 2 * split_act * b_local * factor

    comm = {"gather": 0.0, "grad": 0.0, "tensor": 0.0}  # seconds by what the collectives move
    comm_b = 0.0
    upd_param = 0.0  # parameter bytes each device updates

    def coll(kind: str, nbytes: float, axes: tuple[str, ...], messages: float = 1.0, what: str = "gather") -> None:
        """``nbytes`` (the replica's, of which a stage moves its share) over ``axes`` in ``messages`` equal
        collectives, each priced at its own message size."""
        nonlocal comm_b
        n = math.prod(sizes.get(a, 1) for a in axes)
        nbytes /= stages  # every collective is per layer: a stage's devices move their layers' share
        if n > 1 and nbytes > 0:
            count = max(messages / stages, 1.0)
            comm[what] += count * cluster.collective_seconds(kind, nbytes / count, sizes, axes)
            comm_b += bus_bytes(kind, nbytes, n)

    combined: dict[tuple[str, tuple[str, ...]], float] = {}  # gradient reductions: XLA's combiners fuse them per kind

    def grad_sync(kind: str, nbytes: float, axes: tuple[str, ...]) -> None:
        if math.prod(sizes.get(a, 1) for a in axes) > 1 and nbytes > 0:
            combined[(kind, axes)] = combined.get((kind, axes), 0.0) + nbytes

    dp_axes = tuple(spec_axes(plan.batch_spec))
    for x, zs, bs, names in zip(params, sharded, base, names_, strict=True):
        full = local_bytes(x, bs, sizes)
        z = _group(zs, bs) if plan.zero_stage >= 1 else ()
        if plan.zero_stage >= 2 and profile.native_reduce_scatter:
            grad_sync("reduce_scatter", full, z)
            grad_sync("all_reduce", full / math.prod(sizes[a] for a in z), tuple(a for a in dp_axes if a not in z))
        else:
            grad_sync("all_reduce", full, dp_axes)
        coll("all_gather", full, z, int(x.shape[0]) if names and names[0] == LAYER_AXIS else 1)  # a layer a time
        upd_param += full / math.prod(sizes[a] for a in z)
    for (kind, axes), size in combined.items():
        coll(kind, size, axes, what="grad")
    tokens = b_local * work.tokens_per_example
    if t > 1:
        for x, bs, names in zip(params, base, names_, strict=True):
            width, layers = _tensor_activation_width(tuple(x.shape), bs, bool(names) and names[0] == LAYER_AXIS)
            if width and sequence:  # a reduce-scatter into the sequence split, an all-gather out of it
                nbytes = layers * tokens * width * work.activation_itemsize
                coll("reduce_scatter", nbytes, ("tensor",), k * layers, what="tensor")
                coll("all_gather", nbytes, ("tensor",), k * layers, what="tensor")
            elif width:  # per microbatch and layer
                nbytes = layers * tokens * width * work.activation_itemsize
                coll("all_reduce", nbytes, ("tensor",), k * layers, what="tensor")
        # values whose split the ops cannot carry are gathered forward and reduce-scattered backward
        coll("all_gather", reshard * b_local, ("tensor",), k, what="tensor")
        coll("reduce_scatter", reshard * b_local, ("tensor",), k, what="tensor")
    split = 1 - split_share + split_share / t  # the share of a replica's per-example work one device does
    flops = work.flops_per_example * b_local * split * factor
    if stages > 1:  # the pipeline's backward recomputes its chunk's forward from the stored input
        flops *= 4 / 3
    stack = cluster.stack
    peak = profile.peak_flops
    eff = functools.partial(matmul_efficiency, work, profile, b_local / k, t, split_share)
    priced_apart = stack.causal_skip or stack.attention_efficiency is not None or not stack.fused
    aw = work.attention_work() if priced_apart or not stack.flash_attention else None
    if aw is not None and aw.attention_share and (stack.causal_skip or stack.attention_efficiency is not None):
        # attention's matmuls at the kernel's own rate, the masked half skipped by a flash kernel
        att = flops * aw.attention_share * (0.5 if stack.causal_skip and aw.masked else 1.0)
        att_s = att / (peak * (stack.attention_efficiency or eff(True)))
        compute = flops * (1 - aw.attention_share) / (peak * eff(False)) + att_s
    else:
        compute = flops / (peak * eff())
    mem_bytes = act_traffic + 2 * upd_param + upd_param + 2 * opt_local
    if aw is not None and not stack.fused:  # eager: every elementwise op reads and writes device memory, the
        # backward about twice the forward (the output's gradient and the saved inputs read, the input's written)
        scale = mp.compute_dtype.itemsize / work.activation_itemsize
        mem_bytes += 3 * aw.elementwise_bytes * scale * b_local * split * factor - act_traffic
    if aw is not None and not stack.flash_attention:  # scores written and read by separate kernels
        again = stack.score_bytes_forward if plan.remat != "none" else 0.0  # recomputed with the block
        mem_bytes += aw.score_elements * b_local / t * (stack.score_bytes + again)
    offload = 2 * policy.host_bytes_per_example * b_local / profile.host_bandwidth  # out to the host and back
    bandwidth = profile.memory_seconds(mem_bytes, memory["total"])  # a small step streams from the caches
    bubble = 1.0
    if stages > 1:  # interleaving V chunks per stage divides the fill and drain by V (Narayanan et al. 2021)
        virtual = plan.pipeline_virtual if plan.pipeline_schedule == "interleaved" else 1
        bubble += (stages - 1) / (virtual * max(plan.num_microbatches, stages))
    # each further microbatch is one more trip through the accumulation loop (a launch's fixed cost)
    launches = 1 if stages > 1 else k  # a pipeline's microbatches are ticks of one program
    work_s = (compute + bandwidth + offload) / stages * bubble
    comm_s = sum(comm.values())
    # what the stack cannot overlap waits: a tensor-parallel all-reduce between two dependent matmuls, a
    # gradient reduction issued after the backward
    exposed = (0.0 if stack.tensor_overlap else comm["tensor"]) + (0.0 if stack.grad_overlap else comm["grad"])
    hidden = max(work_s, comm_s - exposed) + exposed
    total = (hidden if profile.overlap else work_s + comm_s) + profile.launch_seconds * launches
    time = {  # per device: a stage does 1/S of its replica's work, and waits in the bubble
        "compute": compute / stages,
        "memory": bandwidth / stages,
        "offload": offload / stages,
        "bubble": work_s - (compute + bandwidth + offload) / stages,
        "collectives": comm_s,
        "exposed": exposed if profile.overlap else comm_s,
        "launch": profile.launch_seconds,
        "total": total,
    }
    return Estimate(memory, time, comm_b, cuts, factor)
