"""Gradient accumulation over microbatches with `lax.scan`, normalised by the number of real samples.

The loss contract is *sum, count*: ``loss_sum_fn(params, microbatch, rng) -> (loss_sum, num_real)`` (or
``(loss_sum, (num_real, aux))`` with ``has_aux=True``), where ``loss_sum`` adds the loss of the real samples
(or tokens) only and ``num_real`` counts them. Summing both over microbatches and dividing once at the end
gives exactly the full-batch mean loss and gradient, whatever the padding or masking.

When the batch does not split evenly, every leaf is padded with zeros along axis 0 and ``batch[mask_key]``
marks the real rows (an existing per-sample or per-token mask is padded with ``False``; a missing one is added
with shape ``[batch]``). The loss must read that mask, e.g. ``jnp.sum(per_sample * mb["mask"])``.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.microbatch import accumulate_gradients
    >>> def loss_sum_fn(p, mb, rng):
    ...     err = (mb["x"] * p["w"] - mb["y"]) ** 2
    ...     return jnp.sum(err * mb["mask"]), jnp.sum(mb["mask"])
    >>> batch = {"x": jnp.arange(6.0), "y": jnp.zeros(6), "mask": jnp.ones(6, bool)}
    >>> loss, grads, metrics = accumulate_gradients(loss_sum_fn, {"w": jnp.float32(1.0)}, batch, 4)
    >>> round(float(loss), 4), round(float(grads["w"]), 4), int(metrics["num_real"])
    (9.1667, 18.3333, 6)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from openhosti_jax.errors import BatchError, ShardingError
from openhosti_jax.sharding.batch import is_key, per_row_keys
from openhosti_jax.state.contracts import SummedLossFn


def batch_size_of(batch: Any) -> int:
    """The shared leading dimension of every leaf of ``batch`` but its PRNG keys (`openhosti_jax.sharding.batch.
    is_key`: every microbatch gets them whole); `BatchError` naming the leaves that differ."""
    leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(batch) if not is_key(x)]
    if not leaves:
        raise BatchError("expected a batch with at least one array leaf that is not a PRNG key, found none")
    sizes = {jax.tree_util.keystr(p): (jnp.shape(x)[0] if jnp.ndim(x) else None) for p, x in leaves}
    distinct = set(sizes.values())
    if None in distinct or len(distinct) != 1:
        raise BatchError(
            "expected every batch leaf (PRNG keys aside) to share one leading (batch) dimension, found "
            + ", ".join(f"{k or '<root>'}: {v if v is not None else 'scalar'}" for k, v in sizes.items())
            + "; give every leaf shape [batch, ...]"
        )
    return distinct.pop()


def key_leaves(batch: Any) -> Any:
    """A tree like ``batch`` of bools: which leaves are PRNG keys (`openhosti_jax.sharding.batch.is_key`)."""
    return jax.tree.map(is_key, batch)


def _constrain(tree: Any, keys: Any, sharding: NamedSharding) -> Any:
    """``tree``'s leaves constrained to ``sharding``, its keys replicated on the same mesh."""
    whole = NamedSharding(sharding.mesh, PartitionSpec())
    return jax.tree.map(lambda x, k: jax.lax.with_sharding_constraint(x, whole if k else sharding), tree, keys)


def _shard_count(sharding: NamedSharding | None) -> int:
    """How many ways ``sharding`` splits axis 0 (the microbatch rows)."""
    if sharding is None or not sharding.spec:
        return 1
    first = sharding.spec[0]
    names = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    return math.prod(sharding.mesh.shape[n] for n in names)


def microbatch_layout(batch_size: int, num_microbatches: int, multiple: int = 1) -> tuple[int, int]:
    """``(microbatch_size, padded_batch)`` for splitting ``batch_size`` rows into ``num_microbatches``.

    The microbatch size is rounded up to ``multiple`` (the number of batch shards) so every microbatch spreads
    evenly over the devices.
    """
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise BatchError(f"expected num_microbatches to be a positive int, found {num_microbatches!r}")
    size = -(-batch_size // num_microbatches)
    size = -(-size // multiple) * multiple
    return size, size * num_microbatches


def _pad_with_mask(batch: Any, padded: int, mask_key: str) -> Any:
    """Zero-pad every leaf to ``padded`` rows and mark the real rows in ``batch[mask_key]``."""
    if not isinstance(batch, Mapping):
        raise BatchError(
            f"the batch needs padding to {padded} rows, which requires a dict batch to carry the "
            f"{mask_key!r} mask; found {type(batch).__name__}. Pass a dict, or a batch whose size divides "
            "evenly into the microbatches"
        )
    n = batch_size_of(batch)
    out = dict(batch)
    if mask_key not in out:
        out[mask_key] = jnp.ones((n,), bool)

    def pad(x: jax.Array) -> jax.Array:
        if per_row_keys(x, n):  # padding rows are masked out: any key serves them
            return jnp.concatenate([x, jnp.broadcast_to(x[:1], (padded - n, *x.shape[1:]))])
        return x if is_key(x) else jnp.pad(x, [(0, padded - n)] + [(0, 0)] * (jnp.ndim(x) - 1))

    return jax.tree.map(pad, out)


def _split(
    batch: Any,
    num_microbatches: int,
    *,
    microbatch_sharding: NamedSharding | None = None,
    mask_key: str = "mask",
) -> tuple[Any, Any]:
    """(``batch`` stacked as `split_microbatches` says, a tree of bools: which of its leaves are keys)."""
    n = batch_size_of(batch)
    size, padded = microbatch_layout(n, num_microbatches, _shard_count(microbatch_sharding))
    if padded != n:
        batch = _pad_with_mask(batch, padded, mask_key)

    def stack(x: jax.Array, key: bool) -> jax.Array:
        if key and not per_row_keys(x, padded):  # every microbatch gets the same keys, whole
            return jnp.broadcast_to(x[None], (num_microbatches, *x.shape))
        x = x.reshape((size, num_microbatches) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    keys = key_leaves(batch)
    stacked = jax.tree.map(stack, batch, keys)
    if microbatch_sharding is not None:
        spec = PartitionSpec(None, *microbatch_sharding.spec)
        stacked = _constrain(stacked, keys, NamedSharding(microbatch_sharding.mesh, spec))
    return stacked, keys


def split_microbatches(
    batch: Any,
    num_microbatches: int,
    *,
    microbatch_sharding: NamedSharding | None = None,
    mask_key: str = "mask",
) -> Any:
    """Stack ``batch`` into ``[num_microbatches, microbatch, ...]`` leaves, padding (with a mask) if needed.

    Microbatch ``i`` holds rows ``i, i + k, i + 2k, ...``: with the batch sharded on axis 0, every device
    keeps its own rows and each microbatch is spread over all batch shards
    (no data moves unless padding is needed). PRNG keys in the batch stay replicated: a key (or a batch of keys
    of another size) is given whole to every microbatch, a batch of one key per row is cut with the rows.
    """
    return _split(batch, num_microbatches, microbatch_sharding=microbatch_sharding, mask_key=mask_key)[0]


def _check_sharding(name: str, value: Any) -> None:
    leaves = jax.tree.leaves(value, is_leaf=lambda s: isinstance(s, Sharding))
    bad = [type(s).__name__ for s in leaves if not isinstance(s, Sharding)]
    if bad:
        raise ShardingError(f"expected {name} to be a Sharding or a pytree of Shardings, found {bad}")


def accumulate_gradients(
    loss_sum_fn: SummedLossFn,
    params: Any,
    batch: Any,
    num_microbatches: int,
    rng: jax.Array | None = None,
    *,
    has_aux: bool = False,
    accum_sharding: Any = None,
    microbatch_sharding: NamedSharding | None = None,
    accum_dtype: jnp.dtype = jnp.float32,
    mask_key: str = "mask",
) -> tuple[jax.Array, Any, dict[str, Any]]:
    """Mean loss and gradient over all real samples of ``batch``, computed ``num_microbatches`` at a time.

    Args:
      loss_sum_fn: ``(params, microbatch, rng) -> (loss_sum, num_real)`` (see the module docstring).
      params: the pytree to differentiate.
      batch: pytree of ``[batch, ...]`` arrays (global view; sharded on axis 0 under jit).
      num_microbatches: how many sequential microbatches (``lax.scan`` steps).
      rng: a key; microbatch ``i`` gets ``fold_in(rng, i)``; ``None`` passes ``None``.
      has_aux: ``loss_sum_fn`` returns ``(loss_sum, (num_real, aux))``; aux leaves are summed over microbatches.
      accum_sharding: sharding (or pytree of shardings matching ``params``) of the fp32 accumulator, e.g. the
        ZeRO gradient shardings, independent of how the compute is laid out.
      microbatch_sharding: sharding of one microbatch's rows, e.g. ``NamedSharding(mesh, P(("data",)))``.
      accum_dtype: accumulator dtype; the returned gradients take each parameter's dtype.
      mask_key: where padding rows are marked when the batch does not split evenly.

    Returns:
      ``(mean_loss, grads, metrics)`` with ``metrics = {"loss", "num_real"}`` plus ``"aux"`` when ``has_aux``.
    """
    if accum_sharding is not None:
        _check_sharding("accum_sharding", accum_sharding)
    if microbatch_sharding is not None and not isinstance(microbatch_sharding, NamedSharding):
        raise ShardingError(
            f"expected microbatch_sharding to be a NamedSharding, found "
            f"{type(microbatch_sharding).__name__}; build one with NamedSharding(mesh, PartitionSpec('data'))"
        )
    stacked, keys = _split(batch, num_microbatches, microbatch_sharding=microbatch_sharding, mask_key=mask_key)

    def summed(p: Any, mb: Any, key: jax.Array | None) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        out = loss_sum_fn(p, mb, key)
        loss_sum, rest = out
        num_real, aux = rest if has_aux else (rest, None)
        return loss_sum.astype(accum_dtype), (jnp.asarray(num_real, accum_dtype), aux)

    grad_fn = jax.value_and_grad(summed, has_aux=True)

    def constrain(acc: Any) -> Any:
        return acc if accum_sharding is None else jax.lax.with_sharding_constraint(acc, accum_sharding)

    def body(carry: tuple, xs: tuple) -> tuple[tuple, None]:
        g_acc, loss_acc, n_acc, aux_acc = carry
        i, mb = xs
        if microbatch_sharding is not None:
            mb = _constrain(mb, keys, microbatch_sharding)
        key = None if rng is None else jax.random.fold_in(rng, i)
        (loss_sum, (num_real, aux)), g = grad_fn(params, mb, key)
        g_acc = constrain(jax.tree.map(lambda a, b: a + b.astype(accum_dtype), g_acc, g))
        aux_acc = None if aux is None else jax.tree.map(jnp.add, aux_acc, aux)
        return (g_acc, loss_acc + loss_sum, n_acc + num_real, aux_acc), None

    zeros = constrain(jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), accum_dtype), params))
    aux0 = None
    if has_aux:
        first = jax.tree.map(lambda x: x[0], stacked)
        aux_shape = jax.eval_shape(lambda: summed(params, first, rng)[1][1])
        aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
    zero = jnp.zeros((), accum_dtype)
    xs = (jnp.arange(num_microbatches), stacked)
    (g_sum, loss_sum, n_sum, aux_sum), _ = jax.lax.scan(body, (zeros, zero, zero, aux0), xs)
    denom = jnp.maximum(n_sum, 1)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(jnp.result_type(p)), g_sum, params)
    mean_loss = loss_sum / denom
    metrics: dict[str, Any] = {"loss": mean_loss, "num_real": n_sum}
    if has_aux:
        metrics["aux"] = aux_sum
    return mean_loss, grads, metrics
