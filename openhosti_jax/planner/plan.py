"""`ShardingPlan`: every placement decision for one training run, as data that prints as a table.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.planner.plan import ShardingPlan
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
    >>> plan = ShardingPlan.from_zero(params, optax.adam(1e-3), {"stage": 1, "data": 1, "fsdp": 8, "tensor": 1}, 3)
    >>> plan.param_specs["w"]
    P('fsdp', None)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import ShardingError
from openhosti_jax.mesh.build import mesh_sizes
from openhosti_jax.mesh.config import AXES, BATCH_AXES
from openhosti_jax.optim.zero import ZERO_AXES, zero_specs
from openhosti_jax.planner.specs import DEFAULT_MIN_ELEMENTS, spec_axes, validate_specs


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingPlan:
    """Placement of parameters, gradients, optimizer state and batches on a named mesh."""

    mesh_shape: Mapping[str, int]
    """Axis name -> size, in `openhosti_jax.mesh.AXES` order."""
    param_specs: Any
    """A PartitionSpec per parameter leaf (same tree as the params)."""
    grad_specs: Any
    """A PartitionSpec per gradient leaf (ZeRO-2/3: reduce-scattered)."""
    opt_specs: Any
    """A PartitionSpec per optimizer-state leaf (same tree as ``tx.init(params)``)."""
    batch_spec: P = P(BATCH_AXES)
    """Spec of every batch leaf's leading dims (the batch dim is split over the data-parallel axes)."""
    zero_stage: int = 0
    """0: DDP, 1: optimizer state sharded, 2: + gradients, 3: + parameters (FSDP)."""
    num_microbatches: int = 1
    """Gradient-accumulation steps per global batch."""
    pipeline_stages: int = 1
    """Pipeline stages (the ``stage`` axis size)."""
    predicted_bytes: int | None = None
    """Cost model's per-device memory (state + activations), if a cost model was run."""
    compiled_bytes: int | None = None
    """Per-device bytes from the AOT-compiled step's `memory_analysis()`, if it was compiled."""
    notes: tuple[str, ...] = ()
    """Why this plan was chosen, one line each."""
    predicted_seconds: float | None = None
    """Cost model's step time, if a cost model was run."""
    predicted_comm_bytes: int | None = None
    """Cost model's bytes sent per device per step by collectives."""
    param_shapes: Any = None
    """Abstract parameter tree the plan was made for (printing shows shapes, the audit lists big leaves)."""
    candidates: tuple[str, ...] = ()
    """The search's ranking, one formatted line per candidate (best first)."""

    def __post_init__(self) -> None:
        unknown = set(self.mesh_shape) - set(AXES)
        if unknown:
            raise ShardingError(f"mesh_shape names unknown axes {sorted(unknown)}; expected names from {AXES}")
        bad = [a for a in spec_axes(self.batch_spec) if a not in self.mesh_shape]
        if bad:
            raise ShardingError(f"batch_spec {self.batch_spec} names unknown mesh axes {bad}; use {AXES}")

    @classmethod
    def from_zero(
        cls,
        params: Any,
        tx: optax.GradientTransformation,
        mesh_shape: Mapping[str, int],
        zero_stage: int,
        *,
        base_specs: Any | None = None,
        min_elements: int = DEFAULT_MIN_ELEMENTS,
        zero_axes: tuple[str, ...] = ZERO_AXES,
        **fields: Any,
    ) -> ShardingPlan:
        """The plan for a fixed mesh and ZeRO stage (sharding over ``zero_axes``), with automatic specs for
        unannotated leaves; ``base_specs`` (a tree like ``params``) are kept and ZeRO adds its axes on top."""
        sizes = {a: int(mesh_shape.get(a, 1)) for a in AXES}
        p, g, o = zero_specs(
            params, tx, sizes, zero_stage, base_specs=base_specs, axes=zero_axes, min_elements=min_elements
        )
        return cls(sizes, p, g, o, zero_stage=zero_stage, **fields)

    @property
    def data_parallel_size(self) -> int:
        """How many ways the global batch is split."""
        return math.prod(self.mesh_shape[a] for a in spec_axes(self.batch_spec))

    def validate(self, params: Any, opt_state: Any | None = None) -> None:
        """Raise `ShardingError` listing every spec that does not fit its leaf or this mesh."""
        validate_specs(params, self.param_specs, self.mesh_shape, "params")
        validate_specs(params, self.grad_specs, self.mesh_shape, "grads")
        if opt_state is not None:
            validate_specs(opt_state, self.opt_specs, self.mesh_shape, "opt_state")

    def check_mesh(self, mesh: Mesh) -> None:
        """Raise `ShardingError` if ``mesh`` does not have this plan's axis sizes."""
        sizes = mesh_sizes(mesh)
        if {a: sizes.get(a, 1) for a in self.mesh_shape} != dict(self.mesh_shape):
            raise ShardingError(
                f"plan was made for mesh {dict(self.mesh_shape)} but got mesh {sizes}; build the mesh with "
                "openhosti_jax.build_mesh(MeshConfig.from_sizes(plan.mesh_shape)) or re-plan"
            )

    def shardings(self, mesh: Mesh, specs: Any) -> Any:
        """NamedShardings on ``mesh`` for a pytree of specs."""
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)

    def state_specs(self, state: Any) -> Any:
        """Specs for a whole `TrainState`: step and rng replicated, params and opt_state as planned."""
        replicated = jax.tree.map(lambda _: P(), state)
        return replicated.replace(params=self.param_specs, opt_state=self.opt_specs)

    def batch_shardings(self, mesh: Mesh, batch: Any) -> Any:
        """Shardings for every leaf of a batch (leading dim split by ``batch_spec``; rank-0 leaves replicated)."""
        return jax.tree.map(lambda x: NamedSharding(mesh, self.batch_spec if x.ndim else P()), batch)

    def __str__(self) -> str:
        from openhosti_jax.planner.report import format_plan

        return format_plan(self)
