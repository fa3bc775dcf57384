"""`ShardingPlan`: every placement decision for one training run, as data that prints as a table.

The plan is the decision only: mesh shape, a PartitionSpec per parameter, gradient and optimizer-state leaf, the
batch spec, the ZeRO stage, the microbatch count and the pipeline stages. Why it was chosen (predictions, compiled
bytes, the ranked candidates) is a `openhosti_jax.sharding.report.PlanReport`.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax.sharding.plan import ShardingPlan
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
    >>> plan = ShardingPlan.from_zero(params, optax.adam(1e-3), {"stage": 1, "data": 1, "fsdp": 8, "tensor": 1}, 3)
    >>> plan.param_specs["w"]
    P('fsdp', None)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import ShardingError
from openhosti_jax.mesh.build import mesh_sizes
from openhosti_jax.mesh.config import AXES, BATCH_AXES, EXPERT_AXIS, SEQUENCE_AXIS, TOKEN_AXES
from openhosti_jax.policies.precision import precision as resolve_precision
from openhosti_jax.policies.remat import check_remat
from openhosti_jax.sharding.batch import batch_leaves, leaf_spec
from openhosti_jax.sharding.specs import DEFAULT_MIN_ELEMENTS, is_spec, spec_axes, validate_specs
from openhosti_jax.sharding.table import format_bytes, leaf_rows, spec_str, unsharded_leaves
from openhosti_jax.sharding.zero import ZERO_AXES, Optimizer, zero_specs


def batch_spec_for(mesh_shape: Mapping[str, int]) -> P:
    """The default batch spec on a mesh of ``mesh_shape``: rows over the data-parallel axes (and ``expert`` where
    that axis is larger than 1: outside the experts it is a data axis), and the sequence (a leaf's second dim) over
    ``context`` where that axis is larger than 1.

    >>> batch_spec_for({"data": 2, "context": 4}), batch_spec_for({"data": 8}), batch_spec_for({"expert": 4})
    (P(('data', 'fsdp'), 'context'), P(('data', 'fsdp'),), P(('data', 'fsdp', 'expert'),))
    """
    rows = TOKEN_AXES if int(mesh_shape.get(EXPERT_AXIS, 1)) > 1 else BATCH_AXES
    if int(mesh_shape.get(SEQUENCE_AXIS, 1)) > 1:
        return P(rows, SEQUENCE_AXIS)
    return P(rows)


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
    batch_spec: P | None = None
    """Spec of every batch leaf's leading dims; None (the default) is resolved when the plan is made to the batch dim
    over the data-parallel axes and, where the mesh has a ``context`` axis larger than 1, the sequence dim (the
    second) over it (`batch_spec_for`). A leaf of lower rank takes the spec's first entries only."""
    zero_stage: int = 0
    """0: DDP, 1: optimizer state sharded, 2: + gradients, 3: + parameters (FSDP)."""
    num_microbatches: int = 1
    """Gradient-accumulation steps per global batch."""
    pipeline_stages: int = 1
    """Pipeline stages (the ``stage`` axis size)."""
    pipeline_schedule: str = "1f1b"
    """With ``pipeline_stages`` > 1: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` over ``num_microbatches``."""
    pipeline_virtual: int = 1
    """Chunks per stage of the ``"interleaved"`` schedule (Megatron's virtual stages)."""
    stage_boundaries: tuple[int, ...] = ()
    """With ``pipeline_stages`` > 1: the layer index each stage starts at, then the layer count (empty: the
    partitioner cuts when the state is made)."""
    remat: str = "none"
    """Rematerialisation policy of the model's repeated blocks (`openhosti_jax.policies.remat`)."""
    precision: str = "fp32"
    """Mixed-precision policy name (`openhosti_jax.policies.precision.PRECISIONS`)."""
    sequence_parallel: bool = False
    """With a ``tensor`` axis: the activations between repeated blocks are split over it along the sequence (Megatron's
    sequence parallelism, MaxText's ``activation_embed`` over ``tensor``), so the blocks' norms and residuals are
    not replicated; the tensor-parallel all-reduce becomes a reduce-scatter and an all-gather of the same bytes."""
    collective_matmul: bool = False
    """With ``sequence_parallel`` and no pipeline: the bundled models' tensor-parallel projections run as collective
    matmuls (`openhosti_jax.models.collective`): the all-gather before a column-parallel projection and the
    reduce-scatter after a row-parallel one are rings of ``ppermute`` steps, each beside a matmul it does not wait
    for, so a device that overlaps collectives with compute hides them."""

    def __post_init__(self) -> None:
        if self.batch_spec is None:
            object.__setattr__(self, "batch_spec", batch_spec_for(self.mesh_shape))
        check_remat(self.remat)
        resolve_precision(self.precision)
        unknown = set(self.mesh_shape) - set(AXES)
        if unknown:
            raise ShardingError(f"mesh_shape names unknown axes {sorted(unknown)}; expected names from {AXES}")
        if self.collective_matmul and not (self.sequence_parallel and self.pipeline_stages == 1):
            raise ShardingError(
                "collective_matmul decomposes a sequence-parallel block's collectives outside a pipeline; found "
                f"sequence_parallel={self.sequence_parallel}, pipeline_stages={self.pipeline_stages}; set "
                "sequence_parallel=True and no stages, or collective_matmul=False"
            )
        bad = [a for a in spec_axes(self.batch_spec) if a not in self.mesh_shape]
        if bad:
            raise ShardingError(f"batch_spec {self.batch_spec} names unknown mesh axes {bad}; use {AXES}")

    @classmethod
    def from_zero(
        cls,
        params: Any,
        tx: Optimizer,
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
        """How many ways the global batch's rows are split (the axes of the batch spec's first entry)."""
        return math.prod(self.mesh_shape[a] for a in spec_axes(P(*tuple(self.batch_spec)[:1])))

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
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)

    def batch_shardings(self, mesh: Mesh, batch: Any) -> Any:
        """Shardings for every leaf of a batch: its batch leaves (`openhosti_jax.sharding.batch.batch_leaves`)
        split by ``batch_spec`` (as many of its entries as the leaf has dims), every other leaf (rank 0, PRNG keys,
        leaves without the batch's leading dim) replicated."""
        leaves, treedef = jax.tree.flatten(batch)
        flags = batch_leaves(batch)
        return treedef.unflatten(
            [
                NamedSharding(mesh, leaf_spec(self.batch_spec, x.ndim) if f else P())
                for x, f in zip(leaves, flags, strict=True)
            ]
        )

    def digest(self) -> str:
        """A short digest of the placement decisions; processes compare it before the first step."""
        specs = jax.tree.leaves((self.param_specs, self.grad_specs, self.opt_specs), is_leaf=is_spec)
        text = repr((dict(self.mesh_shape), self.zero_stage, self.batch_spec, self.num_microbatches, specs))
        if (self.remat, self.precision) != ("none", "fp32"):
            text += repr((self.remat, self.precision))
        if self.pipeline_stages > 1:
            text += repr((self.pipeline_stages, self.pipeline_schedule, self.pipeline_virtual, self.stage_boundaries))
        if self.sequence_parallel:
            text += "sequence parallel"
        if self.collective_matmul:
            text += "collective matmul"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def decision(self) -> dict[str, Any]:
        """The choices that make this plan, as JSON (saved with checkpoints so a resumed run keeps them):
        mesh shape, ZeRO stage, microbatches, remat, precision and pipeline stages. `from_zero` with these
        (and the same parameters and rules) rebuilds the plan of a non-pipelined run."""
        return {
            "mesh_shape": {str(k): int(v) for k, v in self.mesh_shape.items()},
            "zero_stage": self.zero_stage,
            "num_microbatches": self.num_microbatches,
            "remat": self.remat,
            "precision": self.precision,
            "pipeline_stages": self.pipeline_stages,
            "sequence_parallel": self.sequence_parallel,
            "collective_matmul": self.collective_matmul,
        }

    def table(self, params: Any | None = None) -> str:
        """The plan as a table; with ``params`` (an abstract tree) the leaves show shapes, largest first, and the
        largest leaves left replicated are listed."""
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh_shape.items())
        specs = jax.tree.leaves(self.param_specs, is_leaf=is_spec)
        lines = [
            "ShardingPlan",
            f"  mesh            {mesh}",
            f"  ZeRO stage      {self.zero_stage}",
            f"  batch spec      {spec_str(self.batch_spec)}  (split {self.data_parallel_size} ways)",
            f"  microbatches    {self.num_microbatches}",
            f"  pipeline stages {self.pipeline_stages}"
            + (
                f"  ({self.pipeline_schedule}, cut at {list(self.stage_boundaries) or 'the partitioner'})"
                if self.pipeline_stages > 1
                else ""
            ),
            f"  remat           {self.remat}",
            f"  precision       {self.precision}",
            *(["  sequence parallel over tensor"] if self.sequence_parallel else []),
            *(["  collective matmuls over tensor"] if self.collective_matmul else []),
            f"  sharded leaves  {sum(1 for s in specs if spec_axes(s))}/{len(specs)}",
            "  parameter specs (largest first):" if params is not None else "  parameter specs:",
            *leaf_rows(self.param_specs, params),
        ]
        audit = unsharded_leaves(self.param_specs, params) if params is not None else []
        if audit:
            lines += ["  largest unsharded leaves:"]
            lines += [f"    {path:<46} {str(shape):<18} {format_bytes(n)}" for path, shape, n in audit]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
