"""The ZeRO-3 memory mode of the balanced step: parameters gathered per microbatch inside a masked loop.

`BalancedGradFn` with ``gather="step"`` gathers the sharded parameters once per step, so every device holds them
whole while it runs its uneven loop. With ``gather="microbatch"`` the parameters stay sharded: every device runs
``max(counts)`` iterations, each of which all-gathers the parameters (XLA frees each gathered copy after its use),
computes a gradient only while ``j < counts[i]`` (a ``lax.cond``; an idle device skips the work), and
reduce-scatters that iteration's gradient onto the shards. Every device runs the same collectives, so the trip
counts may differ in work but not in communication; the iterations synchronise the devices, which is why the
`Rebalancer` prices this mode as ``sum_j max_{i: n_i > j} 1 / speed_i`` (``synced=True``). A probe times each
device's busy seconds with host callbacks around its gradient (the iterations end together, so finishing
times would say nothing).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from openhosti_jax.balance import make_balanced_grad_fn, place_microbatches
    >>> mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    >>> shards = {"w": NamedSharding(mesh, P("fsdp"))}
    >>> params = jax.device_put({"w": jnp.ones(8)}, shards)
    >>> fn = make_balanced_grad_fn(
    ...     lambda p, mb, r: (jnp.sum(mb["x"] @ p["w"]), jnp.float32(mb["x"].shape[0])),
    ...     mesh, axis="fsdp", capacity=4, grad_shardings=shards, gather="microbatch")
    >>> loss, g, n = fn(params, place_microbatches({"x": np.ones((4, 2, 8), np.float32)}, (3, 1, 0, 0), 3, mesh,
    ...     "fsdp"), (3, 1, 0, 0), jax.random.key(0))
    >>> float(loss), g["w"].tolist(), int(n)
    (8.0, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 8)
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import PartitionSpec

from openhosti_jax.balance.buffer import Axes, as_axes
from openhosti_jax.errors import BalanceError
from openhosti_jax.state.contracts import SummedLossFn

_T0 = time.perf_counter()


def _now(_after: np.ndarray) -> np.ndarray:
    return np.float32(time.perf_counter() - _T0)


def _tick(after: jax.Array) -> jax.Array:
    """Host seconds (f32, since import) once ``after`` is computed."""
    return io_callback(_now, jax.ShapeDtypeStruct((), jnp.float32), after, ordered=False)


def _all_varying(leaves: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    """Each leaf made varying over every balanced axis (so `jax.grad` inserts no hidden collective)."""
    out = []
    for a in leaves:
        missing = tuple(x for x in axes if x not in jax.typeof(a).manual_axis_type.varying)
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def sharded_dims(specs: Any, axis: Axes) -> list[tuple[int, tuple[str, ...]] | None]:
    """Per parameter leaf: ``(dim, axes)`` of the one dimension sharded over balanced axes, or None (replicated)."""
    balanced, out = set(as_axes(axis)), []
    for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec)):
        found = []
        for d, entry in enumerate(spec):
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            if names and set(names) <= balanced:
                found.append((d, names))
            elif set(names) & balanced:
                raise BalanceError(f"a parameter spec {spec} mixes balanced axes {sorted(balanced)} with others")
        if len(found) > 1:
            raise BalanceError(f"expected at most one dimension sharded over the balanced axes, found {spec}")
        out.append(found[0] if found else None)
    return out


def masked_local(loss_sum_fn: SummedLossFn, axis: Axes, stalls: bool, specs: Any, timed: bool):
    """The shard_map body: ``(params_shards, buffer, counts, rng, throttle) -> (loss, grads_shards, n, busy)``."""
    axes = as_axes(axis)
    dims = sharded_dims(specs, axis)

    def gather(leaves):
        return [
            x if d is None else jax.lax.all_gather(x, d[1], axis=d[0], tiled=True)
            for x, d in zip(leaves, dims, strict=True)
        ]

    def scatter(leaves):
        out = []
        for g, d in zip(leaves, dims, strict=True):
            if d is None:
                out.append(jax.lax.psum(g, axes))
                continue
            g = jax.lax.psum_scatter(g, d[1], scatter_dimension=d[0], tiled=True)
            rest = tuple(a for a in axes if a not in d[1])
            out.append(jax.lax.psum(g, rest) if rest else g)
        return out

    def local(params, buffer, counts, rng, throttle):
        from openhosti_jax.balance.grad import _stall

        i = jax.lax.axis_index(axes)
        n = counts[i]
        offset = jnp.cumsum(counts)[i] - n
        leaves, treedef = jax.tree.flatten(params)
        grad_fn = jax.value_and_grad(loss_sum_fn, has_aux=True)
        slots = jax.tree.leaves(buffer)[0].shape[0]
        zero = jax.lax.pcast(jnp.zeros((), jnp.float32), axes, to="varying")

        def body(j, carry):
            loss_acc, n_acc, g_acc, busy = carry
            whole = jax.tree.unflatten(treedef, _all_varying(gather(leaves), axes))  # the collective of iteration j
            k = jnp.minimum(j, slots - 1)
            mb = jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, k, keepdims=False), buffer)
            key = jax.random.fold_in(rng, offset + j)

            def work(p):
                start = _tick(jnp.sum(jax.tree.leaves(p)[0])) if timed else zero
                p = jax.tree.map(lambda a: a + (start * 0).astype(a.dtype), p)  # the work starts after the tick
                (loss, n_real), g = grad_fn(p, mb, key)
                loss, n_real = loss.astype(jnp.float32), jnp.asarray(n_real, jnp.float32)
                if throttle is not None and stalls:
                    loss = loss + _stall(throttle[i], loss * 0)
                took = _tick(loss + jnp.sum(jax.tree.leaves(g)[0]) * 0) - start if timed else zero
                loss, n_real, took = _all_varying([loss, n_real, took], axes)
                return loss, n_real, _all_varying(jax.tree.leaves(g), axes), took

            def idle(p):
                return zero, zero, [jnp.zeros_like(x) for x in jax.tree.leaves(p)], zero

            loss, n_real, g, took = jax.lax.cond(j < n, work, idle, whole)
            g_acc = [a + b.astype(a.dtype) for a, b in zip(g_acc, scatter(g), strict=True)]
            return loss_acc + loss, n_acc + n_real, g_acc, busy + took

        g0 = [jnp.zeros_like(x) for x in leaves]
        init = (zero, zero, g0, zero)
        loss, n_real, g_acc, busy = jax.lax.fori_loop(0, jnp.max(counts), body, init)
        loss, n_real = jax.lax.psum(loss, axes), jax.lax.psum(n_real, axes)
        grads = jax.tree.unflatten(treedef, [g / n_real.astype(g.dtype) for g in g_acc])
        return loss / n_real, grads, n_real, busy[None]

    return local
