"""Text tables for a `ShardingPlan`: the mesh, the largest leaves' specs, memory, and why it won.

Example:
    >>> from openhosti_jax.planner.report import format_bytes
    >>> format_bytes(3 * 2**20)
    '3.00 MiB'
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
from jax.sharding import PartitionSpec as P

from openhosti_jax.planner.specs import spec_axes

if TYPE_CHECKING:
    from openhosti_jax.planner.plan import ShardingPlan


def format_bytes(n: float | None) -> str:
    """Human-readable bytes (binary units)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _spec_str(spec: P) -> str:
    return "(" + ", ".join("-" if e is None else (e if isinstance(e, str) else "+".join(e)) for e in spec) + ")"


def leaf_rows(plan: ShardingPlan, params: object | None = None, top: int = 8) -> list[str]:
    """One line per parameter leaf spec, the largest first when shapes are known (``params`` abstract tree)."""
    specs = jax.tree_util.tree_flatten_with_path(plan.param_specs, is_leaf=lambda x: isinstance(x, P))[0]
    if params is None:
        return [f"  {jax.tree_util.keystr(p):<48} {_spec_str(s)}" for p, s in specs[:top]]
    shapes = jax.tree.leaves(params)
    rows = sorted(zip(specs, shapes, strict=True), key=lambda r: -math.prod(r[1].shape))
    return [f"  {jax.tree_util.keystr(p):<48} {str(tuple(x.shape)):<18} {_spec_str(s)}" for (p, s), x in rows[:top]]


def format_plan(plan: ShardingPlan, params: object | None = None) -> str:
    """The plan as a table (leaf shapes, largest first, from ``params`` or the plan's ``param_shapes``)."""
    from openhosti_jax.planner.audit import unsharded_leaves

    params = params if params is not None else plan.param_shapes
    mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh_shape.items())
    n_sharded = sum(1 for s in jax.tree.leaves(plan.param_specs, is_leaf=lambda x: isinstance(x, P)) if spec_axes(s))
    n_total = len(jax.tree.leaves(plan.param_specs, is_leaf=lambda x: isinstance(x, P)))
    lines = [
        "ShardingPlan",
        f"  mesh            {mesh}",
        f"  ZeRO stage      {plan.zero_stage}",
        f"  batch spec      {_spec_str(plan.batch_spec)}  (split {plan.data_parallel_size} ways)",
        f"  microbatches    {plan.num_microbatches}",
        f"  pipeline stages {plan.pipeline_stages}",
        f"  sharded leaves  {n_sharded}/{n_total}",
        f"  memory/device   predicted {format_bytes(plan.predicted_bytes)}, "
        f"compiled {format_bytes(plan.compiled_bytes)}"
        + (
            f" (ratio {plan.predicted_bytes / plan.compiled_bytes:.2f})"
            if plan.predicted_bytes and plan.compiled_bytes
            else ""
        ),
        f"  comm/step       {format_bytes(plan.predicted_comm_bytes)} sent per device"
        + (f", predicted step {plan.predicted_seconds * 1e3:.2f} ms" if plan.predicted_seconds is not None else ""),
        "  parameter specs (largest first):",
        *leaf_rows(plan, params),
    ]
    audit = unsharded_leaves(plan, params)
    if audit:
        lines += ["  largest unsharded leaves:"]
        lines += [f"    {path:<46} {str(shape):<18} {format_bytes(n)}" for path, shape, n in audit]
    if plan.candidates:
        lines += ["  candidates (best first):", *[f"    {c}" for c in plan.candidates]]
    if plan.notes:
        lines += ["  why:", *[f"    {n}" for n in plan.notes]]
    return "\n".join(lines)
