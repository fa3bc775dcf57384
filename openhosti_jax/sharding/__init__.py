"""Sharding decisions as data: PartitionSpecs, logical-axis and tensor-parallel rules, ZeRO stages, the
`ShardingPlan` and its `PlanReport`, and the one batch placer."""

from openhosti_jax.sharding.batch import place_batch
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import CandidateRow, PlanReport
from openhosti_jax.sharding.rules import DEFAULT_RULES, Rules, logical_spec
from openhosti_jax.sharding.specs import auto_spec, spec_axes, validate_specs
from openhosti_jax.sharding.table import format_bytes
from openhosti_jax.sharding.zero import ZERO_AXES, opt_state_specs, zero_specs

__all__ = [
    "DEFAULT_RULES",
    "ZERO_AXES",
    "CandidateRow",
    "PlanReport",
    "Rules",
    "ShardingPlan",
    "auto_spec",
    "format_bytes",
    "logical_spec",
    "opt_state_specs",
    "place_batch",
    "spec_axes",
    "validate_specs",
    "zero_specs",
]
