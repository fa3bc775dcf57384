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


def active_sequence_sharding(
    mesh: Any, batch_axes: Any, axis: str = "tensor", collective: bool = False
) -> contextlib.AbstractContextManager[None]:
    """Within the block, `constrain_sequence` splits an activation's batch dim over ``batch_axes`` and its sequence
    dim (the second) over ``axis`` of ``mesh`` (an axis, or a tuple: ``("context", "tensor")``): a plan's sequence
    parallelism (`ShardingPlan.sequence_parallel`);
    ``collective``: the blocks' projections run as collective matmuls (`collective_matmul_mesh`)."""
    return _setting("sequence_sharding", (mesh, batch_axes, axis, collective))


def collective_matmul_mesh() -> tuple[Any, Any, str | None] | None:
    """``(mesh, batch_axes, context_axis)`` where the enclosing step asks its blocks' tensor-parallel projections to
    run as collective matmuls (`ShardingPlan.collective_matmul`; ``context_axis``: the axis that splits the
    sequence outside ``tensor``, or None), else None."""
    active = getattr(_local, "sequence_sharding", None)
    if active is None or not active[3]:
        return None
    axis = active[2]
    return active[0], active[1], axis[0] if isinstance(axis, tuple) and len(axis) > 1 else None


def sequence_sharded() -> bool:
    """Whether the enclosing step splits activations along the sequence (`active_sequence_sharding`)."""
    return getattr(_local, "sequence_sharding", None) is not None


def constrain_sequence(x: Any) -> Any:
    """``x`` split over the batch and sequence axes set by `active_sequence_sharding` (unchanged outside one, and
    for values that are not arrays of rank >= 3 whose batch and sequence dims the axes divide)."""
    active = getattr(_local, "sequence_sharding", None)
    if active is None or not isinstance(x, jax.Array) or x.ndim < 3:
        return x
    mesh, batch_axes, axis, _ = active
    shape = dict(mesh.shape)
    names = batch_axes if isinstance(batch_axes, tuple) else (batch_axes,) if batch_axes else ()
    ways = 1
    for name in names:
        ways *= shape.get(name, 1)
    seq = 1
    for name in axis if isinstance(axis, tuple) else (axis,):
        seq *= shape.get(name, 1)
    if x.shape[0] % ways or x.shape[1] % seq:
        return x
    spec = jax.sharding.PartitionSpec(batch_axes, axis, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


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
