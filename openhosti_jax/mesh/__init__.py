"""Device meshes: configuration, construction, multi-process start-up, local launcher, barriers.

The barrier itself is ``openhosti_jax.mesh.barrier.barrier`` (named like its module, so not re-exported here).
"""

from openhosti_jax.mesh.barrier import agree
from openhosti_jax.mesh.build import build_mesh, mesh_sizes
from openhosti_jax.mesh.config import AXES, BATCH_AXES, EXPERT_AXIS, SEQUENCE_AXIS, TOKEN_AXES, MeshConfig
from openhosti_jax.mesh.distributed import LaunchInfo, detect_launch, initialize_distributed
from openhosti_jax.mesh.launch import launch_local
from openhosti_jax.mesh.memory import budget_from_devices, device_memory_limit

__all__ = [
    "AXES",
    "BATCH_AXES",
    "EXPERT_AXIS",
    "LaunchInfo",
    "MeshConfig",
    "SEQUENCE_AXIS",
    "TOKEN_AXES",
    "agree",
    "budget_from_devices",
    "build_mesh",
    "detect_launch",
    "device_memory_limit",
    "initialize_distributed",
    "launch_local",
    "mesh_sizes",
]
