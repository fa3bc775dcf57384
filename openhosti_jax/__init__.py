"""openhosti_jax: JAX-first SPMD training. See README.md for the quick start."""

from openhosti_jax import errors
from openhosti_jax.mesh import MeshConfig, build_mesh, initialize_distributed
from openhosti_jax.planner import ShardingPlan
from openhosti_jax.state import TrainState, create_train_state
from openhosti_jax.train import Trainer, spmd

__version__ = "0.1.0"

__all__ = [
    "MeshConfig",
    "ShardingPlan",
    "TrainState",
    "Trainer",
    "build_mesh",
    "create_train_state",
    "errors",
    "initialize_distributed",
    "spmd",
]
