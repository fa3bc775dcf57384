"""Optax combinators for mixed precision: an fp32 master copy of low-dtype params, and dynamic loss scaling.

Each returns an `optax.GradientTransformation` whose state is a NamedTuple of arrays, so it jits, shards and
checkpoints like any optax state. `optimizer_for` wraps an optimizer as a `Precision` policy requires.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from openhosti_jax.policies.optimizers import find_loss_scale, optimizer_for, scale_loss
    >>> params = {"w": jnp.ones((2,), jnp.bfloat16)}
    >>> tx = optimizer_for(optax.sgd(0.5), "bf16_params")
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full((2,), 0.25, jnp.bfloat16)}, state, params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([0.875, 0.875], dtype=bfloat16)
    >>> tx = optimizer_for(optax.sgd(0.5), "fp16")
    >>> state = tx.init({"w": jnp.ones((2,))})
    >>> float(scale_loss(jnp.float32(1.5), state)), int(find_loss_scale(state).skipped)
    (49152.0, 0)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from openhosti_jax.errors import PlanningError, StateError
from openhosti_jax.policies.precision import Precision, precision


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _to_f32(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if _is_float(x) else x, tree)


class MasterWeightsState(NamedTuple):
    """State of `with_master_weights`: the fp32 master copy of the params and the inner optimizer's state."""

    master: Any
    inner: Any


def with_master_weights(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Runs ``tx`` on an fp32 master copy of params stored in a low dtype (bfloat16, float16).

    ``init(params)`` keeps ``master`` = the params cast to float32 and ``inner = tx.init(master)`` (so Adam's
    moments are fp32). ``update(grads, state, params)`` casts the grads to float32, runs ``tx`` on the master and
    applies its updates to it; the updates it returns are float32 and bring the stored params exactly to the new
    master rounded to their dtype: ``optax.apply_updates(params, updates)`` (which computes ``p + u`` in float32
    and casts back to ``p``'s dtype) equals ``new_master.astype(params dtype)``. ``params`` is required.
    """

    def init_fn(params: Any) -> MasterWeightsState:
        master = _to_f32(params)
        return MasterWeightsState(master=master, inner=tx.init(master))

    def update_fn(updates: Any, state: MasterWeightsState, params: Any = None) -> tuple[Any, MasterWeightsState]:
        if params is None:
            raise StateError(
                "with_master_weights: update needs the stored params; call tx.update(grads, state, params)"
            )
        if not isinstance(state, MasterWeightsState):
            raise StateError(f"with_master_weights: expected a MasterWeightsState, found {type(state).__name__}")
        inner_updates, inner = tx.update(_to_f32(updates), state.inner, state.master)
        master = optax.apply_updates(state.master, inner_updates)

        def stored_update(new: Any, p: Any, inner_u: Any) -> Any:
            if not _is_float(p):
                return inner_u
            # The difference of two values of p's dtype is exact in float32 (unless their exponents differ by more
            # than ~16), so p + u lands exactly on the rounded master.
            return new.astype(p.dtype).astype(jnp.float32) - jnp.asarray(p).astype(jnp.float32)

        out = jax.tree.map(stored_update, master, params, inner_updates)
        return out, MasterWeightsState(master=master, inner=inner)

    return optax.GradientTransformation(init_fn, update_fn)


class LossScaleState(NamedTuple):
    """State of `dynamic_loss_scale`: the current scale, the finite steps since it last changed, the count of
    skipped (non-finite) steps, and the inner optimizer's state."""

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array
    inner: Any


def dynamic_loss_scale(
    tx: optax.GradientTransformation,
    init_scale: float = 2.0**15,
    growth_interval: int = 2000,
    factor: float = 2.0,
    min_scale: float = 1.0,
) -> optax.GradientTransformation:
    """Dynamic loss scaling around ``tx``, for float16 compute: the grads it receives are those of ``loss * scale``
    (`scale_loss`).

    ``update`` multiplies the grads by ``1 / scale`` in float32. If every leaf is finite it runs ``tx``, and after
    ``growth_interval`` finite steps in a row multiplies the scale by ``factor`` (unless that overflows). Otherwise
    it returns zero updates, leaves ``tx``'s state untouched, divides the scale by ``factor`` (not below
    ``min_scale``), resets the run of finite steps and counts one skipped step. Branch-free, so it jits.
    """
    if not init_scale > 0 or not min_scale > 0 or init_scale < min_scale:
        raise PlanningError(f"dynamic_loss_scale: need 0 < min_scale <= init_scale, found {min_scale}, {init_scale}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise PlanningError(f"dynamic_loss_scale: growth_interval must be an int >= 1, found {growth_interval!r}")
    if not factor > 1:
        raise PlanningError(f"dynamic_loss_scale: factor must be > 1, found {factor!r}")

    def init_fn(params: Any) -> LossScaleState:
        return LossScaleState(
            scale=jnp.asarray(init_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
            inner=tx.init(params),
        )

    def update_fn(updates: Any, state: LossScaleState, params: Any = None) -> tuple[Any, LossScaleState]:
        if not isinstance(state, LossScaleState):
            raise StateError(f"dynamic_loss_scale: expected a LossScaleState, found {type(state).__name__}")
        inv = 1.0 / state.scale
        grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) * inv if _is_float(g) else g, updates)
        finite = jnp.array(True)
        for g in jax.tree.leaves(grads):
            if _is_float(g):
                finite = finite & jnp.all(jnp.isfinite(g))
        new_updates, new_inner = tx.update(grads, state.inner, params)
        out = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        inner = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old).astype(jnp.result_type(old)), new_inner, state.inner
        )
        good = state.good_steps + 1
        grow = good >= growth_interval
        grown = state.scale * jnp.float32(factor)
        grown = jnp.where(jnp.isfinite(grown), grown, state.scale)
        scale = jnp.where(
            finite,
            jnp.where(grow, grown, state.scale),
            jnp.maximum(state.scale / jnp.float32(factor), jnp.float32(min_scale)),
        )
        good_steps = jnp.where(finite & ~grow, good, 0).astype(jnp.int32)
        skipped = state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        return out, LossScaleState(scale=scale.astype(jnp.float32), good_steps=good_steps, skipped=skipped, inner=inner)

    return optax.GradientTransformation(init_fn, update_fn)


def find_loss_scale(opt_state: Any) -> LossScaleState | None:
    """The first `LossScaleState` in ``opt_state`` (searching tuples, chains, `MasterWeightsState`, any pytree), or
    None."""
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LossScaleState)):
        if isinstance(leaf, LossScaleState):
            return leaf
    return None


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``loss * scale`` of the `LossScaleState` in ``opt_state``; ``loss`` unchanged when there is none."""
    found = find_loss_scale(opt_state)
    return loss if found is None else loss * found.scale


def optimizer_for(tx: optax.GradientTransformation, policy: str | Precision) -> optax.GradientTransformation:
    """``tx`` wrapped as ``policy`` requires: `with_master_weights` when it stores params in a low dtype, then
    `dynamic_loss_scale` (outermost, so grads are unscaled first) when it scales the loss; else ``tx`` itself.
    The same ``tx`` and policy give the same object back, so its abstract state is traced once."""
    p = precision(policy)
    if not (p.master_weights or p.loss_scaling):
        return tx
    try:
        return _wrapped(tx, p)
    except TypeError:  # an unhashable transformation: wrap it afresh
        return _wrapped.__wrapped__(tx, p)


@functools.lru_cache(maxsize=64)
def _wrapped(tx: optax.GradientTransformation, p: Precision) -> optax.GradientTransformation:
    if p.master_weights:
        tx = with_master_weights(tx)
    if p.loss_scaling:
        tx = dynamic_loss_scale(tx)
    return tx


__all__ = [
    "MasterWeightsState",
    "with_master_weights",
    "LossScaleState",
    "dynamic_loss_scale",
    "find_loss_scale",
    "scale_loss",
    "optimizer_for",
]
