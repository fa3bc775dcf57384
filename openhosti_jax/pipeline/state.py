"""Stage-local pipeline training: each stage's devices hold only their layers' parameters, gradients and optimizer
state, and a step runs the schedule and the optimizer in one jitted program.

The parameters live packed, as the executor runs them (`openhosti_jax.pipeline.packing.Packing`): a ``(V, S, N)``
buffer whose row ``(v, d)`` holds chunk ``v * S + d``, sharded over the mesh's ``stage`` axis, so a device keeps
``1/S`` of the parameters and, since an elementwise optimizer's state mirrors them, ``1/S`` of its moments. Over a
``tensor`` axis of size ``T`` each row is ``T`` slots, one per tensor rank, and every leaf of the state ``1/T`` again
(each rank its Megatron block of a tensor-split weight). Over an ``expert`` axis of size ``X`` each row is ``X``
expert slots: a mixture-of-experts layer's experts (and their moments) ``1/X`` per expert rank, the other leaves
whole on every rank. With ``zero_stage`` >= 1 the optimizer state is further
sharded over ``fsdp`` inside a stage (and the parameters too at stage 3); the gradient stays stage- (and
tensor-) sharded. The model's first layers (an embedding) sit on the first stage and its
last (the head) on the last: nothing is shared between stages.

`unpack_state` gives the per-layer parameters and the optimizer state ``tx.init`` would make for them, to train
or checkpoint without a pipeline; `pack_state` takes them back onto a pipelined mesh.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.mesh import MeshConfig, build_mesh
    >>> from openhosti_jax.pipeline import LayerCost, evaluate_partition, gpipe
    >>> s = 2 if jax.device_count() % 2 == 0 else 1
    >>> mesh = build_mesh(MeshConfig(stage=s, data=-1))
    >>> layers = [lambda p, x: jnp.tanh(x @ p)] * 2
    >>> cut = evaluate_partition([LayerCost(1, 1, 1, 1, 1, 1)] * 2, (0, 1, 2)[:: 3 - s], 2)
    >>> state = init_pipeline_state([jnp.eye(3), 2 * jnp.eye(3)], optax.sgd(0.1), mesh, cut, gpipe(s, 2))
    >>> step = make_pipeline_train_step(layers, lambda y, t: jnp.mean((y - t) ** 2), mesh, cut, gpipe(s, 2), state)
    >>> state, metrics = step(state, (jnp.ones((16, 3)), jnp.zeros((16, 3))))
    >>> int(state.step), state.params.shape[1] == s
    (1, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PipelineError
from openhosti_jax.mesh import mesh_sizes
from openhosti_jax.pipeline.costs import Layer
from openhosti_jax.pipeline.executor import Batch, pipelined_loss_and_grads
from openhosti_jax.pipeline.packing import EXPERT, Packing
from openhosti_jax.pipeline.partitioner import StagePartition
from openhosti_jax.pipeline.schedule import Schedule
from openhosti_jax.pipeline.tensor import TENSOR
from openhosti_jax.state.contracts import MeanLossFn
from openhosti_jax.state.guard import all_finite


class PipelineState(struct.PyTreeNode):
    """A pipelined train state: the step, the packed parameters and their optimizer state."""

    step: jax.Array
    params: jax.Array
    """The ``(V, S, N)`` packed parameters."""
    opt_state: Any
    """``tx.init(params)``: moments packed like the parameters."""
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    packing: Packing = struct.field(pytree_node=False)
    """How the layers' parameters map to the buffer."""
    layer_shapes: tuple[Any, ...] = struct.field(pytree_node=False)
    """The layers' abstract parameters."""
    zero_stage: int = struct.field(pytree_node=False, default=0)
    """ZeRO inside a stage: 1-2 shard the optimizer state over ``fsdp``, 3 the parameters too."""
    sequence: Any = struct.field(pytree_node=False, default=None)
    """The model's `openhosti_jax.pipeline.split.LayerSequence`, when the state was made from a model."""
    partition: Any = struct.field(pytree_node=False, default=None)
    """The stage cut (`StagePartition`), when made from a model."""
    schedule: Any = struct.field(pytree_node=False, default=None)
    """The schedule, when made from a model."""
    remat: str = struct.field(pytree_node=False, default="none")
    """The remat policy each layer runs under inside its chunk's recompute (the executor already recomputes a
    chunk's forward from its stored input; this frees each layer's residuals during it)."""
    sequence_parallel: bool = struct.field(pytree_node=False, default=False)
    """With a ``tensor`` axis: the activations between layers are split over it along the sequence."""


def _row_spec(expert: bool, tensor: bool, fsdp: bool) -> P:
    """The spec of a packed buffer: rows over ``stage``, each row's expert slots over ``expert``, their tensor
    slots over ``tensor``, each slot over ``fsdp`` (ZeRO inside a stage)."""
    inner = tuple(a for a, on in ((EXPERT, expert), (TENSOR, tensor), ("fsdp", fsdp)) if on)
    return P(None, "stage", inner if len(inner) > 1 else inner[0] if inner else None)


def _specs(state_like: Any, zero_stage: int, sizes: dict[str, int]) -> tuple[P, Any]:
    """(parameter spec, optimizer-state specs): packed leaves over ``stage``, ``expert`` (where the packing has
    expert slots) and ``tensor`` (and ``fsdp`` per the ZeRO stage)."""
    tensor, fsdp = sizes.get(TENSOR, 1) > 1, sizes.get("fsdp", 1) > 1
    expert = state_like.packing.expert > 1
    param_spec = _row_spec(expert, tensor, fsdp and zero_stage >= 3)
    packed = _row_spec(expert, tensor, fsdp and zero_stage >= 1)
    shape = state_like.params.shape
    opt_specs = jax.tree.map(lambda x: packed if jnp.shape(x) == shape else P(), state_like.opt_state)
    return param_spec, opt_specs


def state_shardings(state: PipelineState, mesh: Mesh) -> PipelineState:
    """The `NamedSharding` of every leaf of ``state`` on ``mesh``."""
    param_spec, opt_specs = _specs(state, state.zero_stage, mesh_sizes(mesh))
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    return state.replace(
        step=named(P()),
        params=named(param_spec),
        opt_state=jax.tree.map(named, opt_specs, is_leaf=lambda x: isinstance(x, P)),
    )


def init_pipeline_state(
    params: Sequence[Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    partition: StagePartition,
    schedule: Schedule,
    *,
    zero_stage: int = 0,
    tensor_specs: Sequence[Any] | None = None,
    abstract: bool = False,
) -> PipelineState:
    """The `PipelineState` of per-layer ``params`` and ``tx``, placed stage-local on ``mesh``. With a ``tensor``
    axis, ``tensor_specs`` (per layer, a `PartitionSpec` per parameter leaf, e.g. from
    `openhosti_jax.sharding.tensor.base_specs`) say which dim of each leaf is split over it (`Packing`); with an
    ``expert`` axis, which dim of a leaf holds experts split over it (each expert rank then keeps its experts, their
    gradients and optimizer state, `openhosti_jax.sharding.rules.expert_specs` names them). ``abstract``: the
    state's shapes only (`jax.eval_shape`), to lower a step for devices that are not attached."""
    if zero_stage not in (0, 1, 2, 3):
        raise PipelineError(f"zero_stage must be 0-3 (ZeRO inside a stage), found {zero_stage!r}")
    if partition.num_layers != len(params):
        raise PipelineError(
            f"the partition cuts {partition.num_layers} layers but {len(params)} layer parameter trees were given; "
            "partition the same layer list"
        )
    sizes = mesh_sizes(mesh)
    packing = Packing(
        params,
        partition,
        schedule,
        align=sizes.get("fsdp", 1),
        tensor=sizes.get(TENSOR, 1),
        expert=sizes.get(EXPERT, 1),
        tensor_specs=tensor_specs,
    )
    shapes = tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), p) for p in params)

    def build(params: Sequence[Any]) -> PipelineState:
        packed = packing.pack(list(params))
        return PipelineState(jnp.zeros((), jnp.int32), packed, tx.init(packed), tx, packing, shapes, zero_stage)

    shapes_only = jax.eval_shape(build, list(params))
    if abstract:  # shapes to lower a step with, nothing allocated (``params`` may be ShapeDtypeStructs)
        return shapes_only
    return jax.jit(build, out_shardings=state_shardings(shapes_only, mesh))(list(params))


def make_pipeline_train_step(
    layers: Sequence[Layer],
    mean_loss_fn: MeanLossFn,
    mesh: Mesh,
    partition: StagePartition,
    schedule: Schedule,
    state: PipelineState,
    *,
    donate: bool = True,
    guard: bool = True,
) -> Callable[[PipelineState, Batch], tuple[PipelineState, dict[str, jax.Array]]]:
    """A jitted ``step(state, (inputs, targets)) -> (state, {"loss", "grad_norm"})``: the schedule's loss and
    packed gradient, then ``state.tx`` on the packed parameters, everything kept stage-local (``state`` gives the
    layout and shardings; over a ``tensor`` axis each stage's layers run tensor-parallel, sequence-parallel too
    where ``state.sequence_parallel``). With ``guard`` a step whose loss or gradient is not finite leaves the state
    as it was (`openhosti_jax.state.guard`; the metrics add ``skipped_nonfinite``)."""
    run = pipelined_loss_and_grads(
        layers,
        mean_loss_fn,
        mesh,
        partition,
        schedule,
        state.packing,
        state.layer_shapes,
        sequence_parallel=state.sequence_parallel,
    )
    shardings = state_shardings(state, mesh)
    grad_sharding = NamedSharding(mesh, _row_spec(state.packing.expert > 1, mesh_sizes(mesh).get(TENSOR, 1) > 1, False))

    def update(state: PipelineState, grads: Any) -> PipelineState:
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state)

    def step(state: PipelineState, batch: Batch) -> tuple[PipelineState, dict[str, jax.Array]]:
        loss, grads = run(state.params, batch)
        grads = jax.lax.with_sharding_constraint(grads, grad_sharding)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if not guard:
            return update(state, grads), metrics
        ok = all_finite((loss, grads))  # a lax.cond, so the donated state is still updated in place
        new = jax.lax.cond(ok, update, lambda s, g: s, state, grads)
        return new, {**metrics, "skipped_nonfinite": jnp.logical_not(ok).astype(jnp.int32)}

    return jax.jit(
        step,
        in_shardings=(shardings, None),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=(0,) if donate else (),
    )


def unpack_state(state: PipelineState) -> tuple[list[Any], Any]:
    """(per-layer parameters, the optimizer state ``state.tx.init`` makes for them) of a pipelined state: what a
    plain step trains and a checkpoint holds; new arrays, which a later donating step of ``state`` leaves alone."""
    packing = state.packing
    shape = state.params.shape
    opt = jax.tree.map(lambda x: packing.unpack(x) if jnp.shape(x) == shape else jnp.copy(x), state.opt_state)
    return packing.unpack(state.params), opt


def pack_state(
    params: Sequence[Any],
    opt_state: Any,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    partition: StagePartition,
    schedule: Schedule,
    *,
    zero_stage: int = 0,
    step: int | jax.Array = 0,
    tensor_specs: Sequence[Any] | None = None,
) -> PipelineState:
    """A `PipelineState` holding per-layer ``params`` and their (unpipelined) ``opt_state`` (`unpack_state`'s
    inverse), placed stage-local on ``mesh`` (``tensor_specs`` as `init_pipeline_state` takes them).

    Raises `PipelineError` when the layer count or the optimizer state's structure does not match."""
    template = init_pipeline_state(
        params, tx, mesh, partition, schedule, zero_stage=zero_stage, tensor_specs=tensor_specs
    )
    expected = jax.tree.structure(tx.init(list(params)))
    if jax.tree.structure(opt_state) != expected:
        raise PipelineError(
            f"the optimizer state does not match {len(params)} layers under this optimizer: expected the structure "
            f"of tx.init(params) {expected}, found {jax.tree.structure(opt_state)}; restore it with the same layer "
            "list and optimizer it was saved with"
        )
    layer_def = jax.tree.structure(list(params))
    is_layers = lambda x: isinstance(x, list) and jax.tree.structure(x) == layer_def  # noqa: E731
    packing = template.packing
    packed_opt = jax.tree.map(lambda x: packing.pack(x) if is_layers(x) else jnp.copy(x), opt_state, is_leaf=is_layers)
    placed = state_shardings(template, mesh)
    return jax.device_put(
        template.replace(step=jnp.asarray(step, jnp.int32), opt_state=packed_opt),
        placed,
    )
