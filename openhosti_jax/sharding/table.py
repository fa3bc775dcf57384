"""Text rows for sharding decisions: bytes, specs, the parameter leaves with their specs, and the audit of the
largest leaves a plan leaves replicated (candidates for a rule or an annotation).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from openhosti_jax.sharding.table import format_bytes, unsharded_leaves
    >>> format_bytes(3 * 2**20)
    '3.00 MiB'
    >>> params = {"big": jax.ShapeDtypeStruct((1001, 7), jnp.float32), "w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    >>> [(path, n) for path, _, n in unsharded_leaves({"big": P(), "w": P("fsdp")}, params)]
    [("['big']", 28028)]
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from openhosti_jax.sharding.specs import is_spec, spec_axes
from openhosti_jax.sizes import leaf_bytes


def format_bytes(n: float | None) -> str:
    """Human-readable bytes (binary units)."""
    if n is None:
        return "-"
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"


def spec_str(spec: P) -> str:
    """A spec as ``(fsdp, -)``: one entry per dim, ``-`` for replicated, ``+`` joining several axes."""
    return "(" + ", ".join("-" if e is None else (e if isinstance(e, str) else "+".join(e)) for e in spec) + ")"


def leaf_rows(param_specs: Any, params: Any | None = None, top: int = 8) -> list[str]:
    """One line per parameter leaf spec, the ``top`` largest first when the abstract ``params`` are given."""
    specs = jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=is_spec)[0]
    if params is None:
        return [f"  {jax.tree_util.keystr(p):<48} {spec_str(s)}" for p, s in specs[:top]]
    rows = sorted(zip(specs, jax.tree.leaves(params), strict=True), key=lambda r: -leaf_bytes(r[1]))
    return [f"  {jax.tree_util.keystr(p):<48} {str(tuple(x.shape)):<18} {spec_str(s)}" for (p, s), x in rows[:top]]


def unsharded_leaves(param_specs: Any, params: Any, top: int = 5) -> list[tuple[str, tuple, int]]:
    """The ``top`` largest leaves of ``params`` whose spec is fully replicated: (path, shape, bytes), largest
    first."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = jax.tree.leaves(param_specs, is_leaf=is_spec)
    rows = [
        (jax.tree_util.keystr(path), tuple(x.shape), leaf_bytes(x))
        for (path, x), s in zip(flat, specs, strict=True)
        if not spec_axes(s)
    ]
    return sorted(rows, key=lambda r: -r[2])[:top]
