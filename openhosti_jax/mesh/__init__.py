"""Device meshes: configuration, construction, multi-process start-up."""

from openhosti_jax.mesh.build import build_mesh, mesh_sizes
from openhosti_jax.mesh.config import AXES, BATCH_AXES, MeshConfig
from openhosti_jax.mesh.distributed import initialize_distributed

__all__ = ["AXES", "BATCH_AXES", "MeshConfig", "build_mesh", "initialize_distributed", "mesh_sizes"]
