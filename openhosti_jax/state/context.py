"""The shardings active while an ``@spmd`` step is traced, so library helpers can place intermediates.

Example:
    >>> from openhosti_jax.state.context import constrain_gradients
    >>> constrain_gradients({"w": 1.0})  # outside an @spmd step: unchanged
    {'w': 1.0}
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax

_local = threading.local()


@contextlib.contextmanager
def _setting(name: str, value: Any) -> Iterator[None]:
    prev = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, prev)


def active_gradient_shardings(shardings: Any) -> contextlib.AbstractContextManager[None]:
    """Within the block, `constrain_gradients` places gradients with ``shardings`` (a pytree of NamedSharding)."""
    return _setting("grad_shardings", shardings)


def constrain_gradients(grads: Any) -> Any:
    """Apply the active gradient shardings (if any, and if the tree matches) with `with_sharding_constraint`."""
    shardings = getattr(_local, "grad_shardings", None)
    if shardings is None:
        return grads
    if jax.tree.structure(shardings) != jax.tree.structure(grads):
        return grads
    return jax.lax.with_sharding_constraint(grads, shardings)


def active_activation_sharding(
    mesh: Any, batch_axes: Any, axis: Any = None, collective: bool = False, tensor: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """Within the block, `constrain_activation` splits an activation's batch dim over ``batch_axes`` and its
    sequence dim (the second) over ``axis`` of ``mesh`` (None: whole; an axis; or a tuple: ``("context",
    "tensor")``), as the plan's batch spec and sequence parallelism (`ShardingPlan.sequence_parallel`) say;
    `constrain_logits` splits a model's output over the batch axes and its last dim over ``tensor`` (the axis the
    output head's vocabulary is split over, or None); ``collective``: the blocks' tensor-parallel projections run as
    collective matmuls (`collective_matmul_mesh`).

    Placing the activations between blocks (and the embedding's output and the logits) is what makes a ZeRO-3
    step gather its weights for each use: left to itself XLA's partitioner may keep a weight sharded and gather the
    activations of the whole global batch instead (seen compiling Llama-3 8B for 64 TPU v5p chips: its embedding
    lookup and output head ran on every sequence of the batch on every chip)."""
    return _setting("activation_sharding", (mesh, batch_axes, axis, collective, tensor))


def collective_matmul_mesh() -> tuple[Any, Any, str | None] | None:
    """``(mesh, batch_axes, context_axis)`` where the enclosing step asks its blocks' tensor-parallel projections to
    run as collective matmuls (`ShardingPlan.collective_matmul`; ``context_axis``: the axis that splits the
    sequence outside ``tensor``, or None), else None."""
    active = getattr(_local, "activation_sharding", None)
    if active is None or not active[3]:
        return None
    axis = active[2]
    return active[0], active[1], axis[0] if isinstance(axis, tuple) and len(axis) > 1 else None


def activation_key() -> Any:
    """A hashable key of the enclosing `active_activation_sharding` (None outside one): what a block traced under
    it places its activations by."""
    return getattr(_local, "activation_sharding", None)


def activations_sharded() -> bool:
    """Whether the enclosing step places the activations between blocks (`active_activation_sharding`)."""
    return getattr(_local, "activation_sharding", None) is not None


def sequence_split() -> bool:
    """Whether the enclosing step splits the activations between blocks along the sequence over ``tensor``
    (sequence parallelism)."""
    active = getattr(_local, "activation_sharding", None)
    axis = None if active is None else active[2]
    return "tensor" in (axis if isinstance(axis, tuple) else (axis,))


def vocab_axis() -> str | None:
    """The mesh axis the enclosing step splits a vocabulary over (its tensor axis), else None."""
    active = getattr(_local, "activation_sharding", None)
    return None if active is None else active[4]


def _ways(shape: dict[str, int], axes: Any) -> int:
    ways = 1
    for name in axes if isinstance(axes, tuple) else (axes,) if axes else ():
        ways *= shape.get(name, 1)
    return ways


def _constrain(x: Any, mesh: Any, entries: tuple[Any, ...]) -> Any:
    """``x`` constrained to ``P(*entries, None, ...)`` on ``mesh`` where every entry's axes divide its dim; ``x``
    unchanged inside a `jax.shard_map` (its axes are manual there) and for non-arrays."""
    if not isinstance(x, jax.Array) or x.ndim < len(entries):
        return x
    if jax.sharding.get_abstract_mesh().manual_axes:
        return x
    shape = dict(mesh.shape)
    if any(d % _ways(shape, e) for d, e in zip(x.shape, entries, strict=False)):
        return x
    spec = jax.sharding.PartitionSpec(*entries, *([None] * (x.ndim - len(entries))))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def constrain_activation(x: Any) -> Any:
    """``x`` (batch, sequence, ...) split over the batch and sequence axes set by `active_activation_sharding`
    (unchanged outside one, for values that are not arrays of rank >= 3, and where the axes do not divide)."""
    active = getattr(_local, "activation_sharding", None)
    if active is None or not isinstance(x, jax.Array) or x.ndim < 3:
        return x
    mesh, batch_axes, axis, _, _ = active
    return _constrain(x, mesh, (batch_axes, axis))


def constrain_logits(x: Any) -> Any:
    """A model's output ``x`` (batch, sequence, ..., classes) split over the batch axes (and the sequence over
    ``context`` where the batch spec splits it) and its last dim over the vocabulary's tensor axis set by
    `active_activation_sharding`; unchanged outside one."""
    active = getattr(_local, "activation_sharding", None)
    if active is None or not isinstance(x, jax.Array) or x.ndim < 2:
        return x
    mesh, batch_axes, axis, _, tensor = active
    seq = tuple(a for a in (axis if isinstance(axis, tuple) else (axis,)) if a and a != "tensor") or None
    seq = seq[0] if seq and len(seq) == 1 else seq
    if x.ndim == 2:
        return _constrain(x, mesh, (batch_axes, tensor))
    entries = (batch_axes, seq, *([None] * (x.ndim - 3)), tensor)
    return _constrain(x, mesh, entries)


def constrain_unsplit(x: Any) -> Any:
    """``x`` (batch, sequence, features) split over the batch axes (and the sequence over ``context`` where the
    batch spec splits it), whole along the tensor axis, where `active_activation_sharding` is active: the input of
    a vocabulary-parallel output head, gathered out of sequence parallelism first as Megatron's is (left split, XLA
    gathers the head's logit gradients over the vocabulary instead: 2 GiB per chip for Llama-3 8B at 8192 tokens
    on fsdp=16 x tensor=4)."""
    active = getattr(_local, "activation_sharding", None)
    if active is None or not isinstance(x, jax.Array) or x.ndim < 3:
        return x
    mesh, batch_axes, axis, _, _ = active
    seq = tuple(a for a in (axis if isinstance(axis, tuple) else (axis,)) if a and a != "tensor") or None
    return _constrain(x, mesh, (batch_axes, seq[0] if seq and len(seq) == 1 else seq))


def activation_mesh() -> tuple[Any, Any, Any] | None:
    """``(mesh, batch axes, sequence axes)`` of the enclosing `active_activation_sharding`, else None."""
    active = getattr(_local, "activation_sharding", None)
    return None if active is None else (active[0], active[1], active[2])


def gathered(x: Any, spec: Any = None) -> Any:
    """A parameter as a ZeRO-3 step uses it: gathered over the batch axes (its tensor-parallel split ``spec``
    kept, default whole), where `active_activation_sharding` is active; unchanged outside one. A lookup table
    gathered before the lookup keeps the lookup on each device's own tokens (a table split along the rows it is
    indexed by makes XLA gather every token of the batch to every device)."""
    active = getattr(_local, "activation_sharding", None)
    if active is None:
        return x
    entries = tuple(spec) if spec is not None else ()
    return _constrain(x, active[0], entries) if entries else _replicated(x, active[0])


def _replicated(x: Any, mesh: Any) -> Any:
    if not isinstance(x, jax.Array) or jax.sharding.get_abstract_mesh().manual_axes:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def active_token_axes(axes: tuple[str, ...]) -> contextlib.AbstractContextManager[None]:
    """Within the block, a model's layers are traced as one device's part of a call whose batch rows are split over
    the manual mesh ``axes`` of the enclosing `jax.shard_map` (a pipeline stage's batch axes, in the order the rows
    are split): a layer whose result depends on the whole call (an MoE layer's routing capacity and load-balancing
    loss, `openhosti_jax.models.moe.moe_layer`) combines its statistics over them, so each call computes what one
    device computes on the whole batch."""
    return _setting("token_axes", tuple(axes))


def current_token_axes() -> tuple[str, ...]:
    """The manual axes set by the enclosing `active_token_axes` (``()`` outside one)."""
    return getattr(_local, "token_axes", None) or ()


class MicrobatchCount:
    """The accumulation count an ``@spmd`` step runs, and whether the traced step asked for it."""

    def __init__(self, count: int):
        self.count = count
        self.read = False


@contextlib.contextmanager
def active_microbatches(num_microbatches: int) -> Iterator[MicrobatchCount]:
    """Within the block, `current_microbatches` returns ``num_microbatches`` (set by ``@spmd(microbatch=...)``);
    the yielded `MicrobatchCount` records whether anything asked."""
    count = MicrobatchCount(num_microbatches)
    with _setting("microbatches", count):
        yield count


def current_microbatches(default: int = 1) -> int:
    """The accumulation count chosen by the enclosing ``@spmd`` step, else ``default``."""
    value = getattr(_local, "microbatches", None)
    if value is None:
        return default
    value.read = True
    return value.count


class ActivePolicies:
    """The remat and precision policies a traced step runs under, and whether a model call applied them."""

    def __init__(self, remat: str, precision: str):
        self.remat = remat
        self.precision = precision
        self.applied = False
        self.loss_scaled = False


@contextlib.contextmanager
def active_policies(remat: str = "none", precision: str = "fp32") -> Iterator[ActivePolicies]:
    """Within the block, the library's model apply functions (`openhosti_jax.state.model`) run under the remat
    policy ``remat`` and the precision ``precision`` (names from `openhosti_jax.policies`); the yielded
    `ActivePolicies` records whether one of them was called."""
    policies = ActivePolicies(remat, precision)
    with _setting("policies", policies):
        yield policies


def current_policies() -> ActivePolicies | None:
    """The policies set by the enclosing step (None outside one); reading them marks them applied."""
    value = getattr(_local, "policies", None)
    if value is not None:
        value.applied = True
    return value


def mark_loss_scaled() -> None:
    """Record that the traced step multiplied its loss by the loss scale in its optimizer state (what a ``fp16``
    plan needs; `openhosti_jax.make_train_step` does it)."""
    value = getattr(_local, "policies", None)
    if value is not None:
        value.loss_scaled = True


@contextlib.contextmanager
def marking_blocks() -> Iterator[None]:
    """Within the block, the library's model apply functions run each repeated block as one named call of the
    traced program (`openhosti_jax.state.blocks.BLOCK_NAME`), so a pipeline can cut the program there."""
    with _setting("marking_blocks", True):
        yield


def blocks_marked() -> bool:
    """Whether the enclosing code asked for marked block calls (`marking_blocks`)."""
    return bool(getattr(_local, "marking_blocks", False))


class UpdateGuard:
    """Whether the traced step should skip non-finite updates, and whether its state's update did it itself."""

    def __init__(self) -> None:
        self.used = False


@contextlib.contextmanager
def guarding_updates() -> Iterator[UpdateGuard]:
    """Within the block, `openhosti_jax.state.TrainState.apply_gradients` skips an update whose gradients are not
    finite (a ``lax.cond`` around the update, so no second copy of the state is kept) and records that it did."""
    guard = UpdateGuard()
    with _setting("update_guard", guard):
        yield guard


def current_update_guard() -> UpdateGuard | None:
    """The enclosing step's `UpdateGuard` (None when updates are not guarded)."""
    return getattr(_local, "update_guard", None)
