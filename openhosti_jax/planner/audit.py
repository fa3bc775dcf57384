"""Audit of a plan: the largest leaves that stay fully replicated (candidates for a rule or annotation).

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.planner.plan import ShardingPlan
    >>> from openhosti_jax.planner.audit import unsharded_leaves
    >>> params = {"big": jax.ShapeDtypeStruct((1001, 7), jnp.float32), "w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    >>> plan = ShardingPlan.from_zero(params, optax.sgd(0.1), {"fsdp": 8}, 3)
    >>> [(path, nbytes) for path, _, nbytes in unsharded_leaves(plan, params)]
    [("['big']", 28028)]
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from openhosti_jax.planner.plan import ShardingPlan
from openhosti_jax.planner.specs import spec_axes


def unsharded_leaves(plan: ShardingPlan, params: Any | None = None, top: int = 5) -> list[tuple[str, tuple, int]]:
    """The ``top`` largest parameter leaves the plan leaves replicated: (path, shape, bytes), largest first."""
    params = params if params is not None else plan.param_shapes
    if params is None:
        return []
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = jax.tree.leaves(plan.param_specs, is_leaf=lambda x: isinstance(x, P))
    rows = [
        (jax.tree_util.keystr(path), tuple(x.shape), math.prod(x.shape) * np.dtype(x.dtype).itemsize)
        for (path, x), s in zip(flat, specs, strict=True)
        if not spec_axes(s)
    ]
    return sorted(rows, key=lambda r: -r[2])[:top]
