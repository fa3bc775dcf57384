"""The balanced gradient step: an uneven local accumulation loop per device, one reduction at the end.

Each device of the data axis gets a buffer of ``capacity`` microbatches and accumulates its first ``n_i``
(``counts[i]``) inside `jax.shard_map` with no collective: the parameters are made *varying* with
``lax.pcast(..., to="varying")`` first, because `jax.grad` with respect to a replicated input inserts a hidden
``psum`` that deadlocks when devices run different trip counts. One ``psum`` of (loss sum, gradient sum, real
sample count) then gives the exact global mean over real samples, whatever the assignment. Microbatch ``k`` of
the global order gets the key ``fold_in(rng, k)``, so dropout is assignment-independent too.

The loss contract is `openhosti_jax.state.contracts.SummedLossFn`: ``loss_sum_fn(params, microbatch, rng) -> (loss_sum,
num_real)``.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from openhosti_jax.balance import make_balanced_grad_fn, place_microbatches
    >>> mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    >>> loss_sum_fn = lambda p, mb, rng: (jnp.sum((mb["x"] * p["w"]) ** 2), jnp.float32(mb["x"].shape[0]))
    >>> mbs = {"x": np.arange(16.0, dtype=np.float32).reshape(8, 2)}
    >>> step = make_balanced_grad_fn(loss_sum_fn, mesh, capacity=4)
    >>> buf = place_microbatches(mbs, (4, 1, 2, 1), 4, mesh)
    >>> loss, grads, n = step({"w": jnp.float32(1.0)}, buf, (4, 1, 2, 1), jax.random.key(0))
    >>> round(float(loss), 3), round(float(grads["w"]), 3), int(n)
    (77.5, 155.0, 16)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from openhosti_jax.balance.buffer import Axes, as_axes, axes_size, validate_counts
from openhosti_jax.balance.gathered import masked_local
from openhosti_jax.balance.throttle import Throttle
from openhosti_jax.errors import BalanceError
from openhosti_jax.state.contracts import SummedLossFn


def _varying(x: Any, axis: Axes) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.lax.pcast(a, axis, to="varying"), x)


def _to_shardings(tree: Any, shardings: Any, mesh: Mesh) -> Any:
    """``tree`` constrained to ``shardings`` inside jit (`jax.reshard` on a mesh with Explicit axes)."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.tree_util.tree_map(jax.reshard, tree, shardings)
    return jax.lax.with_sharding_constraint(tree, shardings)


def _local_phase(loss_sum_fn: SummedLossFn, axis: Axes, stalls: bool, params, buffer, counts, rng, throttle):
    """Per-device partial sums ``(loss_sum, n_real, grad_sum, sink)``, each with a leading axis of 1.

    ``throttle``: None, or per data position the extra gradient evaluations (int) or, if ``stalls``, the
    seconds of stall (float) per microbatch.
    """
    i = jax.lax.axis_index(axis)
    n = counts[i]
    offset = jnp.cumsum(counts)[i] - n
    params = _varying(params, axis)
    grad_fn = jax.value_and_grad(loss_sum_fn, has_aux=True)

    def one(j):
        mb = jax.tree_util.tree_map(lambda b: jax.lax.dynamic_index_in_dim(b, j, keepdims=False), buffer)
        return mb, jax.random.fold_in(rng, offset + j)

    def body(j, carry):
        loss_acc, n_acc, g_acc, sink = carry
        mb, key = one(j)
        (loss, n_real), g = grad_fn(params, mb, key)
        if throttle is not None and stalls:
            sink = _stall(throttle[i], sink + loss.astype(jnp.float32) * 0)
        elif throttle is not None:
            sink = _extra_work(grad_fn, params, mb, key, throttle[i], sink)
        g_acc = jax.tree_util.tree_map(lambda a, b: a + b.astype(a.dtype), g_acc, g)
        return loss_acc + loss.astype(jnp.float32), n_acc + jnp.asarray(n_real, jnp.float32), g_acc, sink

    zero = jax.lax.pcast(jnp.zeros((), jnp.float32), axis, to="varying")
    g0 = jax.tree_util.tree_map(jnp.zeros_like, params)  # varying, like params
    out = jax.lax.fori_loop(0, n, body, (zero, zero, g0, zero))
    return jax.tree_util.tree_map(lambda a: a[None], out)


def _extra_work(grad_fn, params, mb, key, repeats, sink):
    """``repeats`` more gradients at ``params + 1e-30 * s``: a loop-carried point XLA cannot hoist."""

    def again(_, s):
        p = jax.tree_util.tree_map(lambda a: a + (s * 1e-30).astype(a.dtype), params)
        (loss, _), g = grad_fn(p, mb, key)
        return s + loss.astype(jnp.float32) * 1e-30 + jnp.sum(jax.tree_util.tree_leaves(g)[0]) * 1e-30

    return jax.lax.fori_loop(0, repeats, again, sink)


def _sleep(seconds: np.ndarray, _after: np.ndarray) -> np.ndarray:
    if seconds > 0:
        time.sleep(float(seconds))
    return np.zeros((), np.float32)


def _stall(seconds: jax.Array, sink: jax.Array) -> jax.Array:
    """Block this device for ``seconds`` after ``sink`` is computed (a host callback; other devices run on).

    Devices with nothing to stall skip the callback (a round trip through Python costs each device time).
    """
    call = lambda: sink + io_callback(_sleep, jax.ShapeDtypeStruct((), jnp.float32), seconds, sink, ordered=False)
    return jax.lax.cond(seconds > 0, call, lambda: sink)


class BalancedGradFn:
    """``fn(params, buffer, counts, rng) -> (loss, grads, n_real)`` over an uneven assignment; see module doc.

    ``axis`` may name several mesh axes (``("data", "fsdp")``): every device along them is one balanced position.
    With ``grad_shardings`` (ZeRO-3 / FSDP), the sharded parameters are gathered once per step by XLA before the
    local loop (no collective inside it, so the trip counts may differ) and the gradient leaves the step
    reduce-scattered to ``grad_shardings``; ``gather="microbatch"`` keeps them sharded and gathers them in every
    iteration of a masked loop instead (`openhosti_jax.balance.gathered`). The buffer's slots per device may be any
    number up to ``capacity``.

    ``probe(...)`` returns the same result plus each data position's local-phase seconds, measured by running
    the local phase alone and blocking on each addressable shard from its own thread (NaN for positions owned
    by other processes; `Monitor.observe` gathers them).
    """

    def __init__(
        self,
        loss_sum_fn: SummedLossFn,
        mesh: Mesh,
        axis: Axes,
        capacity: int,
        throttle: Throttle | None,
        grad_shardings: Any = None,
        gather: str = "step",
    ):
        axes = as_axes(axis)
        if gather not in ("step", "microbatch") or (gather == "microbatch" and grad_shardings is None):
            raise BalanceError(
                f"expected gather='step' (sharded parameters gathered once per step) or 'microbatch' (gathered in "
                f"every iteration, ZeRO-3 memory; needs grad_shardings), found gather={gather!r} with "
                f"grad_shardings={'None' if grad_shardings is None else 'given'}"
            )
        if not axes or any(a not in mesh.axis_names for a in axes):
            raise BalanceError(f"expected axis {axis!r} to name axes of the mesh {mesh.axis_names}; pass axis=")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise BalanceError(f"expected capacity to be an int >= 1 (slots per device), found {capacity!r}")
        self.mesh, self.axis, self.capacity = mesh, axis, capacity
        self.size = axes_size(mesh, axis)
        if throttle is not None and len(throttle.factors) != self.size:
            raise BalanceError(
                f"expected a Throttle with {self.size} factors (the {axis!r} axis size), found {len(throttle.factors)}"
            )
        self.throttle = throttle
        self.grad_shardings = grad_shardings
        self._replicated = NamedSharding(mesh, PartitionSpec())
        stalls = throttle is not None and throttle.stalls
        if throttle is None:
            self._extra = None
        else:
            per_position = throttle.stall_seconds if stalls else throttle.extra
            self._extra = jax.device_put(per_position, self._replicated)
        rep, data = PartitionSpec(), PartitionSpec(axis)
        local = partial(_local_phase, loss_sum_fn, axis, stalls)
        if throttle is None:
            local_fn, in_specs = (lambda p, b, c, r: local(p, b, c, r, None)), (rep, data, rep, rep)
        else:
            local_fn, in_specs = local, (rep, data, rep, rep, rep)
        shard_mapped = jax.shard_map(local_fn, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(axis))

        def partials(params, *rest):  # sharded parameters are gathered here, once, before the local loop
            whole = jax.tree_util.tree_map(lambda _: self._replicated, params)
            return shard_mapped(_to_shardings(params, whole, mesh), *rest)

        def reduce(parts):
            loss, grads, n_real, sink = _reduce(parts)
            if grad_shardings is not None:  # the sum over positions becomes a reduce-scatter onto the shards
                grads = _to_shardings(grads, grad_shardings, mesh)
            return loss, grads, n_real, sink

        self._local = jax.jit(partials)
        self._fused = jax.jit(lambda *args: reduce(partials(*args)))
        self._reduce = jax.jit(reduce)
        self._warm: set[str] = set()
        self.gather = gather
        if gather == "microbatch":
            specs = jax.tree_util.tree_map(lambda sh: sh.spec, grad_shardings)

            def build(timed: bool):
                body = masked_local(loss_sum_fn, axis, stalls, specs, timed)
                fn = (lambda p, b, c, r: body(p, b, c, r, None)) if throttle is None else body
                ins = (specs, *in_specs[1:])
                return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=(rep, specs, rep, data)))

            self._masked, self._masked_timed = build(False), build(True)

    def set_throttle(self, throttle: Throttle) -> None:
        """Change the throttled factors without recompiling (the same kind, stall or work, as at construction)."""
        if self.throttle is None or throttle.stalls != self.throttle.stalls or len(throttle.factors) != self.size:
            raise BalanceError(
                f"set_throttle changes the factors of the throttle the step was built with; expected a "
                f"{'none' if self.throttle is None else ('stall' if self.throttle.stalls else 'work')} throttle of "
                f"{self.size} factors, found {throttle!r}; build the step with throttle= to change it later"
            )
        per_position = throttle.stall_seconds if throttle.stalls else throttle.extra
        self.throttle, self._extra = throttle, jax.device_put(per_position, self._replicated)

    def _args(self, params, buffer, counts, rng) -> tuple:
        leading = {np.shape(x)[:1] for x in jax.tree_util.tree_leaves(buffer)}
        slots = next(iter(leading))[0] // self.size if len(leading) == 1 and () not in leading else 0
        if len(leading) != 1 or slots < 1 or slots > self.capacity or slots * self.size != next(iter(leading))[0]:
            raise BalanceError(
                f"expected buffer leaves sharing a leading dim {self.size} x slots (devices x slots per device, "
                f"slots <= capacity {self.capacity}), found leading dims {sorted(leading)}; build it with "
                "place_microbatches(...)"
            )
        counts = validate_counts(counts, self.size, slots)
        args = (params, buffer, jax.device_put(counts, self._replicated), rng)
        return args if self._extra is None else (*args, self._extra)

    def __call__(self, params, buffer, counts: Sequence[int], rng: jax.Array):
        fn = self._masked if self.gather == "microbatch" else self._fused
        loss, grads, n_real, _ = fn(*self._args(params, buffer, counts, rng))
        return loss, grads, n_real

    def probe(self, params, buffer, counts: Sequence[int], rng: jax.Array):
        """``((loss, grads, n_real), seconds)``; ``seconds[i]``: local phase time of data position i."""
        args = self._args(params, buffer, counts, rng)
        if self.gather == "microbatch":  # the devices end together: each one's busy seconds, timed inside
            loss, grads, n_real, busy = self._masked_timed(*args)
            seconds = np.full(self.size, np.nan)
            for shard in busy.addressable_shards:
                seconds[shard.index[0].start or 0] = float(np.asarray(shard.data)[0])
            return (loss, grads, n_real), seconds
        signature = str(jax.tree_util.tree_map(lambda x: (np.shape(x), jnp.result_type(x)), args))
        if signature not in self._warm:  # compile outside the timed region
            jax.block_until_ready(self._local(*args))
            self._warm.add(signature)
        t0 = time.perf_counter()
        partials = self._local(*args)
        seconds = np.full(self.size, -np.inf)

        def wait(shard):
            shard.data.block_until_ready()
            pos = shard.index[0].start or 0
            seconds[pos] = max(seconds[pos], time.perf_counter() - t0)

        threads = [threading.Thread(target=wait, args=(s,)) for s in partials[1].addressable_shards]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds[np.isneginf(seconds)] = np.nan
        loss, grads, n_real, _ = self._reduce(partials)
        return (loss, grads, n_real), seconds


def _reduce(partials):
    loss, n_real, grads, sink = jax.tree_util.tree_map(lambda a: jnp.sum(a, axis=0), partials)
    grads = jax.tree_util.tree_map(lambda g: g / n_real.astype(g.dtype), grads)
    return loss / n_real, grads, n_real, sink


def make_balanced_grad_fn(
    loss_sum_fn: SummedLossFn,
    mesh: Mesh,
    *,
    axis: Axes = "data",
    capacity: int,
    throttle: Throttle | None = None,
    grad_shardings: Any = None,
    gather: str = "step",
) -> BalancedGradFn:
    """A `BalancedGradFn` over ``mesh[axis]`` with up to ``capacity`` microbatch slots per device."""
    return BalancedGradFn(loss_sum_fn, mesh, axis, capacity, throttle, grad_shardings, gather)
