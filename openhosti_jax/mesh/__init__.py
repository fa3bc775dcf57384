"""Device meshes: configuration, construction, multi-process start-up, local launcher, barriers."""

from openhosti_jax.mesh.barrier import agree, barrier
from openhosti_jax.mesh.build import build_mesh, mesh_sizes
from openhosti_jax.mesh.config import AXES, BATCH_AXES, MeshConfig
from openhosti_jax.mesh.distributed import initialize_distributed
from openhosti_jax.mesh.launch import launch_local

__all__ = [
    "AXES",
    "BATCH_AXES",
    "MeshConfig",
    "agree",
    "barrier",
    "build_mesh",
    "initialize_distributed",
    "launch_local",
    "mesh_sizes",
]
