"""openhosti_jax: JAX-first SPMD training. See README.md for the quick start."""

from openhosti_jax import errors
from openhosti_jax.mesh import MeshConfig, build_mesh, initialize_distributed

__version__ = "0.1.0"

__all__ = ["MeshConfig", "build_mesh", "errors", "initialize_distributed"]
