"""Sharding plans: per-leaf specs, ZeRO stage, mesh shape; printable and checkable before anything runs."""

from openhosti_jax.planner.plan import ShardingPlan
from openhosti_jax.planner.report import format_plan
from openhosti_jax.planner.specs import auto_spec, validate_specs

__all__ = ["ShardingPlan", "auto_spec", "format_plan", "validate_specs"]
