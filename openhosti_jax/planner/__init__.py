"""The planner: from abstract shapes, a cost model (workload, device profiles, calibration) scores mesh shapes x
ZeRO stages, and the winner is AOT-verified.

Start with `choose_plan`: it returns the best `ShardingPlan` for a model on the attached devices (or on a
``cluster=`` that is not attached) and its `PlanReport`, choosing the mesh too. Two entry points serve narrower
cases:

- `plan_on_mesh`: when the mesh is already built (the user named its axes) and only the ZeRO stage, remat,
  precision and microbatches are open; `openhosti_jax.create_train_state` and ``@spmd`` call it when they plan.
- ``openhosti_jax.planner.predict.predict``: when the question is what a run would do on a cluster that is not
  attached (step time, tokens/s, MFU, memory per device), for the planner's choice or a fixed configuration; what
  ``openhosti predict`` prints.

Functions named like their module are imported from the module: ``openhosti_jax.planner.workload.workload``,
``openhosti_jax.planner.calibrate.calibrate``, ``openhosti_jax.planner.predict.predict``.
"""

from openhosti_jax.planner.calibrate import device_profile
from openhosti_jax.planner.choose import choose_plan
from openhosti_jax.planner.cost import Estimate, estimate
from openhosti_jax.planner.profiles import PROFILES, DeviceProfile
from openhosti_jax.planner.search import plan_on_mesh
from openhosti_jax.planner.workload import Workload

__all__ = [
    "PROFILES",
    "DeviceProfile",
    "Estimate",
    "Workload",
    "choose_plan",
    "device_profile",
    "estimate",
    "plan_on_mesh",
]
