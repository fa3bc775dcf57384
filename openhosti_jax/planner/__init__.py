"""The planner: from abstract shapes, a cost model (workload, device profiles, calibration) scores mesh shapes x
ZeRO stages, and the winner is AOT-verified. `choose_plan` returns the `ShardingPlan` and its `PlanReport`."""

from openhosti_jax.planner.calibrate import calibrate, device_profile
from openhosti_jax.planner.choose import choose_plan
from openhosti_jax.planner.cost import Estimate, estimate
from openhosti_jax.planner.profiles import PROFILES, DeviceProfile
from openhosti_jax.planner.search import plan_on_mesh
from openhosti_jax.planner.workload import Workload, workload

__all__ = [
    "PROFILES",
    "DeviceProfile",
    "Estimate",
    "Workload",
    "calibrate",
    "choose_plan",
    "device_profile",
    "estimate",
    "plan_on_mesh",
    "workload",
]
