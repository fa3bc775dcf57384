"""A pipelined `ShardingPlan` trains through the same entry points as any other: `create_train_state` builds a
stage-local `openhosti_jax.pipeline.PipelineState` for it, `pipeline_step` is the step the plan selects (``@spmd``
names it), and `Trainer.fit` and `TrainerCheckpoint` run and save that state like any pytree state.

The model's layer sequence is found in it (`openhosti_jax.pipeline.split_layers`), cut into the plan's stages by
the exact partitioner (or at the plan's ``stage_boundaries``), and run on the plan's schedule with
``num_microbatches`` microbatches. On a mesh with a ``tensor`` axis each stage's layers are split over it by the
tensor-parallel specs the unpipelined path uses (the plan's parameter specs, else
`openhosti_jax.sharding.tensor.base_specs`), sequence-parallel where the plan says so. On a mesh with an ``expert``
axis each stage's mixture-of-experts weights (leaves with an ``experts`` logical dim) are split over it as the
unpipelined path splits them (`openhosti_jax.sharding.rules.expert_specs`): each expert rank holds and runs its
experts, with their gradients and optimizer state. `to_model_state` gives the
model's own parameter tree and the optimizer state ``tx.init`` makes for it, to continue without a pipeline (or
save such a checkpoint); `from_model_state` takes them back.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import openhosti_jax as oh
    >>> from openhosti_jax.models.gpt import GPT, GPTConfig
    >>> mesh = oh.build_mesh(oh.MeshConfig(stage=2, data=4))
    >>> plan = oh.ShardingPlan.from_zero({}, None, dict(mesh.shape), 0, pipeline_stages=2, num_microbatches=2)
    >>> tokens = jnp.zeros((8, 16), jnp.int32)
    >>> init = lambda r: GPT(GPTConfig.tiny(n_layers=2), rngs=nnx.Rngs(r))
    >>> state, plan = oh.create_train_state(init, optax.adam(1e-3), mesh, plan=plan, sample_batch=tokens)
    >>> type(state).__name__, state.params.shape[1]
    ('PipelineState', 2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PipelineError
from openhosti_jax.mesh import mesh_sizes
from openhosti_jax.pipeline.costs import layer_costs
from openhosti_jax.pipeline.executor import Batch
from openhosti_jax.pipeline.partitioner import StagePartition, evaluate_partition, partition
from openhosti_jax.pipeline.schedule import make_schedule
from openhosti_jax.pipeline.split import LayerSequence, split_layers
from openhosti_jax.pipeline.state import PipelineState, init_pipeline_state, make_pipeline_train_step, pack_state
from openhosti_jax.pipeline.state import unpack_state as unpack_pipeline_state
from openhosti_jax.pipeline.tensor import tensor_dim
from openhosti_jax.planner.propagate import propagate
from openhosti_jax.policies.precision import precision as resolve_precision
from openhosti_jax.policies.remat import checkpoint
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.rules import expert_specs
from openhosti_jax.sharding.specs import axis_dim, is_spec
from openhosti_jax.sharding.tensor import base_specs
from openhosti_jax.state.contracts import MeanLossFn
from openhosti_jax.state.model import model_parts


def _stage_cut(plan: ShardingPlan, layers: Any, layer_params: Any, sample: Any, chunks: int) -> StagePartition:
    if plan.stage_boundaries:
        if plan.stage_boundaries[-1] != len(layers) or len(plan.stage_boundaries) != chunks + 1:
            raise PipelineError(
                f"the plan cuts at {plan.stage_boundaries} ({len(plan.stage_boundaries) - 1} stages of "
                f"{plan.stage_boundaries[-1]} layers) but the model has {len(layers)} layers to cut into {chunks}; "
                "re-plan for this model, or drop stage_boundaries to let the partitioner cut"
            )
        costs = layer_costs(layers, layer_params, sample)
        return evaluate_partition(costs, plan.stage_boundaries, plan.num_microbatches)
    if chunks > len(layers):
        raise PipelineError(
            f"the plan wants {chunks} stages but the model has {len(layers)} layers (before the blocks, each block, "
            "after them); use at most that many stages"
        )
    return partition(layer_costs(layers, layer_params, sample), chunks, plan.num_microbatches)


def _layer_tensor_specs(plan: ShardingPlan, seq: LayerSequence, params: Any, sizes: dict[str, int]) -> list:
    """Each layer's parameter specs inside a stage: the plan's, where it has one per parameter leaf (the planner's
    plans do), else the tensor-parallel specs the unpipelined path gives the model (`base_specs`: logical names,
    then recognised attention / MLP / embedding modules)."""
    n = len(jax.tree.leaves(params))
    given = jax.tree.leaves(plan.param_specs, is_leaf=is_spec)
    flat = given if len(given) == n and all(is_spec(x) for x in given) else base_specs(params, sizes)
    return seq.split_specs(flat)


def _with_experts(seq: LayerSequence, specs: list | None, params: Any, sizes: dict[str, int]) -> list:
    """Each layer's parameter specs inside a stage (``specs``: the tensor-parallel ones, or None) with every stacked
    experts dim (logical name `openhosti_jax.sharding.rules.EXPERTS`) on ``expert``, as the unpipelined path places
    them: each expert rank holds its experts, their gradients and optimizer state (`Packing`). Raises
    `ShardingError` naming each leaf whose experts the axis does not divide."""
    experts = seq.split_specs(expert_specs(params, sizes))
    if specs is None:
        return experts

    def merged(t: P, e: P) -> P:
        dims = {"expert": axis_dim(e, "expert"), "tensor": tensor_dim(t)}
        names = [tuple(a for a, k in dims.items() if k == i) for i in range(len(e))]
        return P(*[n[0] if len(n) == 1 else n or None for n in names])  # both on one dim: Packing refuses it

    return [tuple(map(merged, t, e)) for t, e in zip(specs, experts, strict=True)]


def _check_tensor_split(seq: LayerSequence, specs: list, paths: list, sample: Any, tensor: int) -> None:
    """Raise `PipelineError` naming every layer whose tensor split a reshape cuts into parts the axis does not
    divide (attention heads, query groups): each tensor rank must hold whole heads, as Megatron requires."""
    carry = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), sample)
    problems = []
    for i, (layer, p) in enumerate(zip(seq.layers, seq.params, strict=True)):
        closed = jax.make_jaxpr(layer)(p, carry)
        dims = [tensor_dim(x) for x in specs[i]]
        cut = propagate(closed.jaxpr, dims + [None] * (len(closed.jaxpr.invars) - len(dims)), tensor).cut_reshapes
        if cut:
            split = [
                f"{path} {x.shape} (dim {d})" for path, x, d in zip(paths[i], p, dims, strict=True) if d is not None
            ]
            problems.append(f"layer {i}: {cut} reshape(s) cut the tensor split of {', '.join(split)}")
        carry = jax.eval_shape(layer, p, carry)
    if problems:
        raise PipelineError(
            f"expected each stage's tensor-parallel layers to split into tensor={tensor} parts of whole attention "
            "heads and key/value groups, found reshapes that cut them:\n  "
            + "\n  ".join(problems)
            + f"\nuse a tensor axis that divides the heads and the key/value heads (found {tensor}), or drop it"
        )


def create_pipeline_state(
    init_fn: Any,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    plan: ShardingPlan,
    sample_batch: Any,
    *,
    key: jax.Array | None = None,
    apply_fn: Any = None,
    model_kwargs: Mapping[str, Any] | None = None,
    abstract: bool = False,
) -> PipelineState:
    """The stage-local state of ``init_fn``'s model for a pipelined ``plan`` (``sample_batch``: the inputs;
    ``model_kwargs``: passed to every call of the model, as `split_layers` takes them). ``abstract``: its shapes
    only, nothing initialised, for lowering the step for devices that are not attached (`lower_pipelined`)."""
    plan.check_mesh(mesh)
    inputs = sample_batch[0] if isinstance(sample_batch, tuple) else sample_batch
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *np.shape(x)[1:]), jnp.result_type(x)), inputs)
    mp = resolve_precision(plan.precision)
    if mp.master_weights or mp.loss_scaling:
        raise PipelineError(
            f"precision {plan.precision!r} stores the parameters in a low dtype or scales the loss, which pipelined "
            "states do not do yet; use precision 'bf16' (fp32 parameters, bf16 compute) or 'fp32'"
        )
    seq = split_layers(init_fn, one, apply_fn=apply_fn, precision=plan.precision, model_kwargs=model_kwargs)
    parts = model_parts(init_fn, one, apply_fn=apply_fn)
    sizes = mesh_sizes(mesh)
    specs = None
    if sizes.get("tensor", 1) > 1:  # checked on the abstract layers, before anything is initialised or compiled
        specs = _layer_tensor_specs(plan, seq, parts.params, sizes)
        paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(parts.params)[0]]
        _check_tensor_split(seq, specs, seq.split_flat(paths, lambda path, j: f"{path}[{j}]"), one, sizes["tensor"])
    if sizes.get("expert", 1) > 1:
        specs = _with_experts(seq, specs, parts.params, sizes)
    init = lambda k: parts.init(k)[0]  # noqa: E731
    k = jax.random.key(0) if key is None else key
    params = jax.eval_shape(init, k) if abstract else init(k)
    layer_params = seq.split(params)
    schedule = make_schedule(plan.pipeline_schedule, plan.pipeline_stages, plan.num_microbatches, plan.pipeline_virtual)
    cut = _stage_cut(plan, seq.layers, layer_params, one, schedule.num_chunks)
    state = init_pipeline_state(
        layer_params, tx, mesh, cut, schedule, zero_stage=plan.zero_stage, tensor_specs=specs, abstract=abstract
    )
    return state.replace(
        sequence=seq, partition=cut, schedule=schedule, remat=plan.remat, sequence_parallel=plan.sequence_parallel
    )


def pipeline_step(
    mean_loss_fn: MeanLossFn, mesh: Mesh, state: PipelineState
) -> Callable[[PipelineState, Batch], tuple[PipelineState, dict[str, jax.Array]]]:
    """The jitted ``step(state, (inputs, targets)) -> (state, {"loss", "grad_norm"})`` of a state made by
    `create_train_state` for a pipelined plan; ``mean_loss_fn(outputs, targets)`` is a mean over examples."""
    if state.sequence is None:
        raise PipelineError(
            "this PipelineState carries no layer sequence; make it with create_train_state(..., plan=pipelined_plan, "
            "sample_batch=...) or call openhosti_jax.pipeline.make_pipeline_train_step with the layers"
        )
    layers = [checkpoint(f, state.remat) for f in state.sequence.layers]
    return make_pipeline_train_step(layers, mean_loss_fn, mesh, state.partition, state.schedule, state)


def to_model_state(state: PipelineState) -> tuple[Any, Any]:
    """(the model's parameter tree, the optimizer state ``tx.init`` makes for it) of a pipelined state."""
    seq = state.sequence
    if seq is None:
        raise PipelineError("this PipelineState carries no layer sequence; use pipeline.unpack_state for its layers")
    layers, opt = unpack_pipeline_state(state)
    shape = jax.tree.structure(layers)
    is_layers = lambda x: isinstance(x, list) and jax.tree.structure(x) == shape  # noqa: E731
    return seq.merge(layers), jax.tree.map(lambda x: seq.merge(x) if is_layers(x) else x, opt, is_leaf=is_layers)


def from_model_state(params: Any, opt_state: Any, like: PipelineState, mesh: Mesh, *, step: int = 0) -> PipelineState:
    """A state like ``like`` (same model, plan and optimizer) holding the model's ``params`` and their
    unpipelined ``opt_state`` (`to_model_state`'s inverse): how a plain run's checkpoint goes back onto the
    pipeline.

    Raises `PipelineError` when the parameters do not fit the model's layer sequence (a changed layer count)."""
    seq = like.sequence
    if jax.tree.structure(params) != seq.treedef:
        raise PipelineError(
            f"the parameters do not match the pipelined model: expected the structure {seq.treedef}, found "
            f"{jax.tree.structure(params)}; restore a checkpoint of the same model (the same layer count)"
        )
    layer_params = seq.split(params)
    is_model = lambda x: jax.tree.structure(x) == seq.treedef  # noqa: E731
    opt_layers = jax.tree.map(lambda x: seq.split(x) if is_model(x) else x, opt_state, is_leaf=is_model)
    state = pack_state(
        layer_params,
        opt_layers,
        like.tx,
        mesh,
        like.partition,
        like.schedule,
        zero_stage=like.zero_stage,
        step=step,
        tensor_specs=like.packing.tensor_specs,
    )
    return state.replace(
        sequence=seq,
        partition=like.partition,
        schedule=like.schedule,
        remat=like.remat,
        sequence_parallel=like.sequence_parallel,
    )


def lower_pipelined(
    init_fn: Any,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    plan: ShardingPlan,
    sample_batch: Any,
    mean_loss_fn: MeanLossFn,
    *,
    apply_fn: Any = None,
    model_kwargs: Mapping[str, Any] | None = None,
) -> jax.stages.Lowered:
    """`pipeline_step` of ``init_fn``'s model under the pipelined ``plan`` lowered on ``mesh`` (attached or not, e.g.
    `openhosti_jax.mesh.topology.target_mesh` of a TPU slice) from abstract state and ``sample_batch`` (``(inputs,
    targets)``, the global batch): nothing is initialised or allocated. ``.compile()`` it for the memory the
    compiler holds the program to."""
    inputs = sample_batch[0] if isinstance(sample_batch, tuple) else sample_batch
    state = create_pipeline_state(
        init_fn, tx, mesh, plan, inputs, apply_fn=apply_fn, model_kwargs=model_kwargs, abstract=True
    )
    step = pipeline_step(mean_loss_fn, mesh, state)
    abstract = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))  # noqa: E731
    with jax.set_mesh(mesh):
        return step.lower(state, jax.tree.map(abstract, sample_batch))
