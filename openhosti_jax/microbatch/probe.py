"""Per-device peak memory of a compiled step: XLA's buffer assignment, else an analytic bound.

`compiled_peak_bytes` reads ``compiled.memory_analysis()``; some GPU/TPU builds return all-zero fields,
which mean *unknown* (``None``), never *zero*. `analytic_peak_bytes` is then a conservative upper bound from
the cost model: the per-device argument and output bytes plus every byte the program touches
(``cost_analysis()[ "bytes accessed"]``), which no set of live buffers can exceed. `peak_bytes` combines them;
its ``fallback`` hook takes a better model (e.g. the planner's prediction).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.microbatch import compiled_peak_bytes, peak_bytes
    >>> c = jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones((1024,))).compile()
    >>> compiled_peak_bytes(c) >= 4096, peak_bytes(c) == compiled_peak_bytes(c)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Sharding

from openhosti_jax.sizes import nbytes
from openhosti_jax.state.jit import footprint_bytes, memory_stats

PeakFn = Callable[[jax.stages.Compiled], int | None]
"""``compiled -> per-device peak bytes`` (``None`` when unknown)."""


def compiled_peak_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Per-device peak bytes from XLA's memory analysis; ``None`` when the backend does not report it.

    The larger of ``peak_memory_in_bytes`` and `footprint_bytes`: the runtime allocates the whole temp block, and
    on CPU the heap simulation's peak can be below it once the step has a loop (`lax.scan` accumulation).
    """
    stats = memory_stats(compiled)
    if stats is None:
        return None
    peak = max(stats["peak"], footprint_bytes(stats))
    return peak if peak > 0 else None


def _shard_bytes(shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
    local = sharding.shard_shape(tuple(shape)) if isinstance(sharding, Sharding) else tuple(shape)
    return nbytes(local, dtype)


def analytic_peak_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Conservative per-device peak: argument + output bytes + ``bytes accessed`` from the cost analysis.

    ``None`` when the backend has no cost analysis either.
    """
    args = jax.tree.leaves(compiled.args_info)
    in_shardings = jax.tree.leaves(compiled.input_shardings, is_leaf=lambda s: isinstance(s, Sharding))
    arg_bytes = sum(_shard_bytes(a.shape, a.dtype, s) for a, s in zip(args, in_shardings, strict=False))
    out_bytes = sum(_shard_bytes(o.shape, o.dtype, o.sharding) for o in jax.tree.leaves(compiled.out_info))
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):
        cost = None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    accessed = float((cost or {}).get("bytes accessed", 0.0))
    if accessed <= 0:
        return None
    return int(arg_bytes + out_bytes + accessed)


def peak_bytes(compiled: jax.stages.Compiled, fallback: PeakFn | None = None) -> int | None:
    """`compiled_peak_bytes`, else ``fallback(compiled)`` (default `analytic_peak_bytes`)."""
    peak = compiled_peak_bytes(compiled)
    if peak is not None:
        return peak
    return (fallback or analytic_peak_bytes)(compiled)
