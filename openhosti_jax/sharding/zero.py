"""ZeRO stages as shardings of parameters, gradients and optax state.

Stage 0 replicates everything (DDP); 1 shards the optimizer state over the data-parallel axes; 2 also
reduce-scatters gradients; 3 also shards parameters (FSDP), which XLA gathers per use.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.sharding.zero import zero_specs
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
    >>> p, g, o = zero_specs(params, optax.adam(1e-3), {"data": 8, "fsdp": 1}, stage=1)
    >>> p["w"], o[0].mu["w"]
    (P(None, None), P('data', None))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PlanningError
from openhosti_jax.sharding.specs import DEFAULT_MIN_ELEMENTS, auto_spec, is_spec

ZERO_AXES: tuple[str, ...] = ("data", "fsdp")
"""The data-parallel axes ZeRO shards state over."""


def opt_state_specs(tx: optax.GradientTransformation, params: Any, leaf_specs: Any) -> Any:
    """Specs for ``tx``'s state: each parameter-shaped leaf (Adam mu, nu, ...) gets its parameter's spec,
    everything else (counts, scalars) is replicated."""
    abstract_state = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        abstract_state,
        leaf_specs,
        transform_non_params=lambda _: P(),
        is_leaf=is_spec,
    )


def zero_specs(
    params: Any,
    tx: optax.GradientTransformation,
    sizes: Mapping[str, int],
    stage: int,
    *,
    base_specs: Any | None = None,
    axes: Sequence[str] = ZERO_AXES,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
) -> tuple[Any, Any, Any]:
    """(param specs, gradient specs, optimizer-state specs) for ZeRO ``stage`` over ``axes``.

    ``base_specs`` are specs already chosen for other reasons (tensor parallelism, user annotations); ZeRO adds
    the data-parallel axes on top of them.
    """
    if stage not in (0, 1, 2, 3):
        raise PlanningError(f"ZeRO stage must be 0, 1, 2 or 3, found {stage!r}")
    if base_specs is None:
        base_specs = jax.tree.map(lambda leaf: P(*([None] * len(leaf.shape))), params)
    sharded = jax.tree.map(
        lambda leaf, base: auto_spec(leaf.shape, sizes, axes, min_elements=min_elements, taken=tuple(base)),
        params,
        base_specs,
    )
    param_specs = sharded if stage >= 3 else base_specs
    grad_specs = sharded if stage >= 2 else base_specs
    opt_specs = opt_state_specs(tx, params, sharded if stage >= 1 else base_specs)
    return param_specs, grad_specs, opt_specs
