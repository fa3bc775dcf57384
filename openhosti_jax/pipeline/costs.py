"""Per-layer costs of a model given as a sequence of layers: FLOPs and bytes from XLA's cost analysis,
parameter and activation bytes, and a roofline time estimate the partitioner balances.

A layer is a function ``layer(params, x) -> y``; `split_modules` turns Flax nnx modules into that form.

Example:
    >>> import jax.numpy as jnp
    >>> layers = [lambda p, x: jnp.tanh(x @ p), lambda p, x: x @ p]
    >>> params = [jnp.ones((8, 16)), jnp.ones((16, 4))]
    >>> costs = layer_costs(layers, params, jnp.ones((2, 8)))
    >>> [c.flops for c in costs]
    [512.0, 256.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from openhosti_jax.errors import PipelineError
from openhosti_jax.flops import jaxpr_flops
from openhosti_jax.sizes import tree_bytes

Layer = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs for one microbatch (forward pass)."""

    flops: float
    """Forward FLOPs from XLA's cost analysis."""
    bytes_accessed: float
    """Bytes read and written by the forward pass (cost analysis)."""
    param_bytes: int
    """Bytes of the layer's parameters."""
    input_bytes: int
    """Bytes of the layer's input activation (what a stage starting here must keep per microbatch)."""
    output_bytes: int
    """Bytes of the layer's output activation."""
    time_s: float
    """Estimated forward time: ``max(flops / peak_flops, bytes_accessed / bandwidth)``, or a measured time."""

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not (np.isfinite(v) and v >= 0)}
        if bad:
            raise PipelineError(f"LayerCost fields must be finite and >= 0, found {bad}; check the cost source")


def layer_costs(
    layers: Sequence[Layer],
    params: Sequence[Any],
    example_input: Any,
    *,
    peak_flops: float = 1e11,
    bandwidth: float = 2e10,
) -> list[LayerCost]:
    """Costs of each layer, chaining abstract shapes from ``example_input`` (one microbatch) through them.

    Nothing runs: each layer is lowered and compiled ahead of time on abstract inputs and its
    ``cost_analysis()`` read (`jaxpr_flops` where the backend reports no FLOPs). ``peak_flops`` /
    ``bandwidth`` (per device) turn counts into a time estimate.
    """
    if len(layers) != len(params):
        raise PipelineError(
            f"expected one params pytree per layer, found {len(layers)} layers and {len(params)} params; "
            "pass params as a list aligned with layers"
        )
    if peak_flops <= 0 or bandwidth <= 0:
        raise PipelineError(f"peak_flops and bandwidth must be > 0, found {peak_flops}, {bandwidth}")
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), example_input)
    out: list[LayerCost] = []
    for i, (layer, p) in enumerate(zip(layers, params, strict=True)):
        p_abs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), p)
        try:
            compiled = jax.jit(layer).lower(p_abs, x).compile()
        except Exception as e:  # noqa: BLE001 - re-raised typed with the layer index
            raise PipelineError(f"layer {i} could not be compiled on input {x}: {e}") from e
        analysis = compiled.cost_analysis()
        if isinstance(analysis, list):  # older jax: one dict per computation
            analysis = analysis[0] if analysis else {}
        analysis = analysis or {}
        flops = float(analysis.get("flops", 0.0)) or jaxpr_flops(layer, p_abs, x)
        moved = float(analysis.get("bytes accessed", 0.0))
        y = jax.eval_shape(layer, p_abs, x)
        out.append(
            LayerCost(
                flops=flops,
                bytes_accessed=moved,
                param_bytes=tree_bytes(p_abs),
                input_bytes=tree_bytes(x),
                output_bytes=tree_bytes(y),
                time_s=max(flops / peak_flops, moved / bandwidth),
            )
        )
        x = y
    return out


def split_modules(modules: Sequence[Any]) -> tuple[list[Layer], list[Any]]:
    """Flax nnx modules -> (``layer(params, x)`` functions, their ``nnx.State`` params) for the pipeline.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> fns, params = split_modules([nnx.Linear(4, 8, rngs=nnx.Rngs(0))])
        >>> fns[0](params[0], jnp.ones((2, 4))).shape
        (2, 8)
    """
    fns: list[Layer] = []
    states: list[Any] = []
    for m in modules:
        graphdef, state = nnx.split(m)
        fns.append(lambda s, x, g=graphdef: nnx.merge(g, s)(x))
        states.append(state)
    return fns, states
