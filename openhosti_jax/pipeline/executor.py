"""SPMD pipeline executor: `jax.shard_map` over the mesh's ``stage`` axis, `lax.ppermute` between neighbours.

Stages may have entirely different parameter structures and activation shapes. Each chunk's parameters are
flattened into one row of a padded ``(V, S, N)`` buffer sharded over ``stage`` (stage ``d`` holds chunks
``v * S + d``); activations between chunks travel as padded flat vectors. Every device scans the schedule's
`TickTable` and picks its chunk's forward or backward body with `lax.switch` on the table entry, so one SPMD
program runs different code per stage. Backward recomputes the chunk's forward from its stored input (only
stage inputs stay in flight). The batch is split over the ``data``, ``fsdp`` and ``expert`` axes; gradients are
averaged over them once, after the schedule. The layers are traced under
`openhosti_jax.state.context.active_token_axes` of those axes, so a mixture-of-experts layer routes each microbatch
of all of them as one call, expert-parallel. Where the packing splits leaves over ``expert`` (a mixture-of-experts
layer's stacked experts), each expert rank holds and runs only its own experts: their gradients are summed over
the other batch axes, those of the leaves every rank holds over ``expert`` too. A ``tensor`` axis is left to XLA
inside the stages: each chunk's row holds every tensor rank's blocks of its weights
(`openhosti_jax.pipeline.packing`), so each stage's layers run tensor-parallel (sequence-parallel too where asked)
with collectives among that stage's devices only (`openhosti_jax.pipeline.tensor`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.mesh import MeshConfig, build_mesh
    >>> from openhosti_jax.pipeline import evaluate_partition, gpipe, LayerCost
    >>> s = 2 if jax.device_count() % 2 == 0 else 1
    >>> mesh = build_mesh(MeshConfig(stage=s, data=-1))
    >>> layers = [lambda p, x: jnp.tanh(x @ p)] * 2
    >>> params = [jnp.eye(3), 2 * jnp.eye(3)]
    >>> cut = evaluate_partition([LayerCost(1, 1, 1, 1, 1, 1)] * 2, (0, 1, 2)[:: 3 - s], 2)
    >>> step = make_pipeline_step(layers, lambda y, t: jnp.mean((y - t) ** 2), mesh, cut, gpipe(s, 2))
    >>> loss, grads = step(params, (jnp.ones((16, 3)), jnp.zeros((16, 3))))
    >>> bool(jnp.allclose(loss, jnp.mean(jnp.tanh(2 * jnp.tanh(1.0)) ** 2)))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import BatchError, PipelineError
from openhosti_jax.mesh import TOKEN_AXES, mesh_sizes
from openhosti_jax.pipeline.costs import Layer
from openhosti_jax.pipeline.packing import EXPERT, Packing
from openhosti_jax.pipeline.partitioner import StagePartition
from openhosti_jax.pipeline.schedule import Schedule
from openhosti_jax.pipeline.split import carriable as _carriable
from openhosti_jax.pipeline.tensor import TENSOR, stage_tensor, whole_along
from openhosti_jax.pipeline.ticks import BACKWARD, FORWARD, tick_table
from openhosti_jax.state.context import active_token_axes
from openhosti_jax.state.contracts import MeanLossFn

Batch = tuple[Any, Any]


def _check(layers: Sequence[Layer], mesh: Mesh, partition: StagePartition, schedule: Schedule) -> None:
    sizes = mesh_sizes(mesh)
    problems = []
    if "stage" not in sizes:
        problems.append(f"the mesh has no 'stage' axis (axes {mesh.axis_names}); build it with build_mesh")
    elif sizes["stage"] != schedule.num_stages:
        problems.append(f"schedule has S={schedule.num_stages} but the mesh's stage axis is {sizes['stage']}")
    if partition.num_stages != schedule.num_chunks:
        problems.append(
            f"partition has {partition.num_stages} stages but the schedule runs {schedule.num_chunks} chunks "
            f"(S={schedule.num_stages} x V={schedule.num_virtual}); partition into {schedule.num_chunks}"
        )
    if partition.num_layers != len(layers):
        problems.append(f"partition cuts {partition.num_layers} layers but {len(layers)} were given")
    if problems:
        raise PipelineError("pipeline request does not fit: " + "; ".join(problems))


def _carrier_dtype(bounds: Sequence[Any]) -> Any:
    """The dtype the activations between chunks travel in: their floats' common one, float32 at least where
    integers or booleans travel too (exact below 2**24); raise `PipelineError` for any other dtype."""
    leaves = [x for b in bounds for x in jax.tree.leaves(b)]
    bad = [
        f"{x.dtype}{list(x.shape)} after chunk {c}"
        for c, b in enumerate(bounds)
        for x in jax.tree.leaves(b)
        if not _carriable(x.dtype)
    ]
    if bad:
        raise PipelineError(
            f"expected the activations between chunks to be floats, or integers and booleans of at most 32 bits; "
            f"found {', '.join(bad)}; cut elsewhere or carry them as floats"
        )
    floats = [x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    dtype = jnp.result_type(*floats) if floats else jnp.dtype(jnp.float32)
    if len(floats) < len(leaves):
        dtype = jnp.promote_types(dtype, jnp.float32)
    return dtype


class _Carrier:
    """An activation pytree as one flat vector of ``dtype`` (each leaf cast, in `jax.tree.leaves` order) and back."""

    def __init__(self, like: Any, dtype: Any):
        leaves, self.treedef = jax.tree.flatten(like)
        self.shapes = [(tuple(x.shape), x.dtype) for x in leaves]
        self.size = sum(int(np.prod(shape)) for shape, _ in self.shapes)
        self.dtype = dtype

    def pack(self, tree: Any) -> jax.Array:
        flat = [jnp.ravel(x).astype(self.dtype) for x in jax.tree.leaves(tree)]
        return jnp.concatenate(flat) if flat else jnp.zeros((0,), self.dtype)

    def unpack(self, flat: jax.Array) -> Any:
        out, at = [], 0
        for shape, dtype in self.shapes:
            n = int(np.prod(shape))
            out.append(flat[at : at + n].reshape(shape).astype(dtype))
            at += n
        return jax.tree.unflatten(self.treedef, out)


def pipelined_loss_and_grads(
    layers: Sequence[Layer],
    mean_loss_fn: MeanLossFn,
    mesh: Mesh,
    partition: StagePartition,
    schedule: Schedule,
    packing: Packing,
    layer_shapes: Sequence[Any],
    *,
    sequence_parallel: bool = False,
) -> Callable[[jax.Array, Batch], tuple[jax.Array, jax.Array]]:
    """``run(packed, (inputs, targets)) -> (loss, packed gradient)``, traceable (the callers jit it): the schedule
    over ``mesh`` on a ``(V, S, N)`` buffer laid out by ``packing``; ``layer_shapes`` are the layers' abstract
    parameters (for the activation shapes between chunks).

    The ``stage`` and batch axes are manual (`jax.shard_map`); a ``tensor`` axis is left to XLA, which partitions
    each stage's layers by the leaves' tensor splits `Packing.chunk_params` places. ``sequence_parallel``: the
    activations between layers (``(batch, sequence, ...)`` leaves) are split over ``tensor`` along the sequence."""
    _check(layers, mesh, partition, schedule)
    sizes = mesh_sizes(mesh)
    tensor = sizes.get(TENSOR, 1)
    if packing.tensor != tensor:
        raise PipelineError(
            f"the parameters are packed for a tensor axis of {packing.tensor} but the mesh's is {tensor}; make the "
            "state (or packing) on this mesh"
        )
    if packing.expert not in (1, sizes.get(EXPERT, 1)):
        raise PipelineError(
            f"the parameters are packed for an expert axis of {packing.expert} but the mesh's is "
            f"{sizes.get(EXPERT, 1)}; make the state (or packing) on this mesh"
        )
    split = tensor > 1
    manual = frozenset(a for a in mesh.axis_names if not (split and a == TENSOR))
    s, m_count, n_chunks = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    batch_axes = tuple(a for a in TOKEN_AXES if a in sizes)  # expert too: its devices hold different rows
    replicas = int(np.prod([sizes[a] for a in batch_axes]))
    # with experts split over expert, each expert rank holds its own experts (summed over the other batch axes)
    # and a copy of the other leaves, a prefix of each tensor slot (summed over expert too)
    experts = packing.expert > 1
    expert_replicas = tuple(a for a in batch_axes if a != EXPERT) if experts else batch_axes
    shared = np.asarray(packing.shared, np.int32).reshape(packing.num_virtual, s)
    shared_max = int(shared.max()) if experts else 0
    ticks = tick_table(schedule)
    table = jnp.asarray(ticks.table)
    chunk_layers = [[layers[i] for i in r] for r in partition.stages]
    n_max, p_dtype = packing.expert_slot, packing.dtype  # a device's part of a row

    def between_layers(h: Any) -> Any:
        """A carry between layers, split along the sequence over ``tensor`` where asked and possible."""
        if not (split and sequence_parallel):
            return h
        seq = lambda x: x.ndim >= 3 and x.shape[1] % tensor == 0  # noqa: E731
        return jax.tree.map(lambda x: lax.with_sharding_constraint(x, P(None, TENSOR)) if seq(x) else x, h)

    def whole(x: jax.Array) -> jax.Array:
        return lax.with_sharding_constraint(x, P()) if split else x

    def for_loss(out: Any) -> Any:
        """The model's outputs whole over ``tensor`` but for their last dim (a vocabulary the head splits stays
        split): the loss may shift or cut them anywhere (`openhosti_jax.pipeline.tensor`)."""
        return jax.tree.map(lambda x: whole_along(x, range(x.ndim - 1)), out) if split else out

    def run(packed: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
        inputs, targets = batch
        n_batch = {x.shape[0] for x in jax.tree.leaves(batch)}
        if len(n_batch) != 1 or next(iter(n_batch)) % (replicas * m_count):
            raise BatchError(
                f"expected every batch leaf to share a leading size divisible by {replicas} replicas x "
                f"{m_count} microbatches, found leading sizes {sorted(n_batch)}; pad or resize the batch"
            )
        mb = next(iter(n_batch)) // (replicas * m_count)
        micro = lambda x: jax.ShapeDtypeStruct((mb, *x.shape[1:]), x.dtype)
        h = jax.tree.map(micro, inputs)
        bounds = []  # abstract activation entering chunk c + 1
        for c in range(n_chunks - 1):
            for layer, li in zip(chunk_layers[c], partition.stages[c], strict=True):
                h = jax.eval_shape(layer, layer_shapes[li], h)
            bounds.append(h)
        a_dtype = _carrier_dtype(bounds)
        packers = [_Carrier(b, a_dtype) for b in bounds]
        a_max = max([p.size for p in packers] + [1])

        def fwd(c: int, row: jax.Array, a_in: jax.Array, x: Any, y: Any) -> tuple[jax.Array, jax.Array]:
            p = packing.chunk_params(c, row, constrain=split)
            h = x if c == 0 else between_layers(packers[c - 1].unpack(whole(a_in)))
            with stage_tensor(tensor), active_token_axes(batch_axes):
                for layer, lp in zip(chunk_layers[c], p, strict=True):
                    h = between_layers(layer(lp, h))
            if c == n_chunks - 1:
                return jnp.zeros(a_max, a_dtype), mean_loss_fn(for_loss(h), y).astype(jnp.float32)
            flat = packers[c].pack(h)
            return whole(jnp.pad(flat, (0, a_max - flat.size))), jnp.zeros((), jnp.float32)

        def forward_branch(c: int, prow, a_in, g_in, x, y):
            out, loss = fwd(c, prow[c // s], a_in, x, y)
            return out, jnp.zeros_like(a_in), jnp.zeros(n_max, p_dtype), loss / m_count

        def backward_branch(c: int, prow, a_in, g_in, x, y):
            _, vjp = jax.vjp(lambda r, a: fwd(c, r, a, x, y), prow[c // s], a_in)
            g_row, g_a = vjp((g_in, jnp.asarray(1.0 / m_count, jnp.float32)))
            return jnp.zeros_like(a_in), g_a, g_row, jnp.zeros((), jnp.float32)

        def idle_branch(prow, a_in, g_in, x, y):
            return (
                jnp.zeros_like(a_in),
                jnp.zeros_like(a_in),
                jnp.zeros(n_max, p_dtype),
                jnp.zeros((), jnp.float32),
            )

        branches = [idle_branch]
        branches += [partial(forward_branch, c) for c in range(n_chunks)]
        branches += [partial(backward_branch, c) for c in range(n_chunks)]
        to_next = [(i, (i + 1) % s) for i in range(s)]
        to_prev = [(i, (i - 1) % s) for i in range(s)]

        def body(prow, xs, ys):
            prow = prow[:, 0]
            d = lax.axis_index("stage")
            xs = jax.tree.map(lambda x: x.reshape(m_count, mb, *x.shape[1:]), xs)
            ys = jax.tree.map(lambda x: x.reshape(m_count, mb, *x.shape[1:]), ys)
            carry = (
                jnp.zeros((ticks.num_act_slots + 1, a_max), a_dtype),
                jnp.zeros((ticks.num_grad_slots + 1, a_max), a_dtype),
                jnp.zeros_like(prow),
                jnp.zeros((), jnp.float32),
            )

            def tick(carry, row):
                acts, grads, g_acc, loss = carry
                op, c, m, a_slot, g_slot, ra_slot, rg_slot = (row[d, k] for k in range(7))
                branch = jnp.where(op == FORWARD, 1 + c, jnp.where(op == BACKWARD, 1 + n_chunks + c, 0))
                x = jax.tree.map(lambda t: t[m], xs)
                y = jax.tree.map(lambda t: t[m], ys)
                out, g_out, g_row, l_add = lax.switch(branch, branches, prow, acts[a_slot], grads[g_slot], x, y)
                g_acc = g_acc.at[c // s].add(g_row)
                acts = acts.at[ra_slot].set(lax.ppermute(out, "stage", to_next))
                grads = grads.at[rg_slot].set(lax.ppermute(g_out, "stage", to_prev))
                return (acts, grads, g_acc, loss + l_add), None

            (_, _, g_acc, loss), _ = lax.scan(tick, carry, table)
            loss = lax.psum(loss, "stage")
            if expert_replicas:
                g_acc = lax.psum(g_acc, expert_replicas)
            if experts and shared_max:  # the leaves every expert rank holds: summed over expert too
                slots = g_acc.reshape(g_acc.shape[0], tensor, packing.slot)
                head = slots[..., :shared_max]
                mine = jnp.arange(shared_max)[None, :] < jnp.asarray(shared)[:, d][:, None]
                head = jnp.where(mine[:, None, :], lax.psum(head, EXPERT), head)
                g_acc = jnp.concatenate([head, slots[..., shared_max:]], axis=-1).reshape(g_acc.shape)
            if batch_axes:
                g_acc = g_acc / replicas
                loss = lax.psum(loss, batch_axes) / replicas
            return loss, g_acc[:, None]

        spec_batch = P(batch_axes or None)
        spec_row = P(None, "stage", EXPERT if experts else None)
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec_row, spec_batch, spec_batch),
            out_specs=(P(), spec_row),
            axis_names=manual,
            check_vma=False,
        )(packed, inputs, targets)

    return run


def make_pipeline_step(
    layers: Sequence[Layer],
    mean_loss_fn: MeanLossFn,
    mesh: Mesh,
    partition: StagePartition,
    schedule: Schedule,
    *,
    tensor_specs: Sequence[Any] | None = None,
) -> Callable[[Sequence[Any], Batch], tuple[jax.Array, list[Any]]]:
    """A jitted ``step(params, (inputs, targets)) -> (loss, grads)`` running ``schedule`` over ``mesh``.

    ``params[i]`` is layer ``i``'s pytree; ``mean_loss_fn(outputs, targets)`` is a mean over examples; the loss and
    the gradients equal those of ``mean_loss_fn(model(inputs), targets)`` on the whole batch. The parameters enter
    whole and are packed per step: `openhosti_jax.pipeline.state` keeps them packed and stage-local instead.
    ``tensor_specs`` (per layer, a `PartitionSpec` per parameter leaf): the dims split over a ``tensor`` axis of
    ``mesh`` (`Packing`); leaves without one are stored split and gathered whole where they are used. A dim a spec
    puts on an ``expert`` axis of ``mesh`` is split over it: each expert rank's layers get its block of such a
    leaf (a mixture-of-experts layer's own experts).
    """
    _check(layers, mesh, partition, schedule)
    sizes = mesh_sizes(mesh)
    tensor, expert = sizes.get(TENSOR, 1), sizes.get(EXPERT, 1)

    @jax.jit
    def step(params: Sequence[Any], batch: Batch) -> tuple[jax.Array, list[Any]]:
        params = list(params)
        packing = Packing(params, partition, schedule, tensor=tensor, expert=expert, tensor_specs=tensor_specs)
        shapes = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p) for p in params]
        run = pipelined_loss_and_grads(layers, mean_loss_fn, mesh, partition, schedule, packing, shapes)
        loss, g_packed = run(packing.pack(params), batch)
        return loss, packing.unpack(g_packed)

    return step


def pipeline_value_and_grad(
    layers: Sequence[Layer],
    params: Sequence[Any],
    batch: Batch,
    mean_loss_fn: MeanLossFn,
    mesh: Mesh,
    partition: StagePartition,
    schedule: Schedule,
) -> tuple[jax.Array, list[Any]]:
    """Loss and per-layer gradients of ``mean_loss_fn(model(inputs), targets)``, computed by the pipeline.

    One-shot form of `make_pipeline_step` (which keep the compiled step for reuse).
    """
    return make_pipeline_step(layers, mean_loss_fn, mesh, partition, schedule)(params, batch)
