"""Sharding plans: per-leaf specs, ZeRO stage, mesh shape; chosen by a cost model, printable, AOT-verified."""

from openhosti_jax.planner.audit import unsharded_leaves
from openhosti_jax.planner.auto import plan
from openhosti_jax.planner.cost import Estimate, estimate
from openhosti_jax.planner.plan import ShardingPlan
from openhosti_jax.planner.profile import PROFILES, DeviceProfile, calibrate, device_profile
from openhosti_jax.planner.report import format_plan
from openhosti_jax.planner.rules import DEFAULT_RULES, logical_spec
from openhosti_jax.planner.search import plan_on_mesh
from openhosti_jax.planner.specs import auto_spec, validate_specs

__all__ = [
    "DEFAULT_RULES",
    "PROFILES",
    "DeviceProfile",
    "Estimate",
    "ShardingPlan",
    "auto_spec",
    "calibrate",
    "device_profile",
    "estimate",
    "format_plan",
    "logical_spec",
    "plan",
    "plan_on_mesh",
    "unsharded_leaves",
    "validate_specs",
]
