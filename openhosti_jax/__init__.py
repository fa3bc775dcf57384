"""openhosti_jax: JAX-first SPMD training. See README.md for the quick start.

Subpackages not imported here (import them by name): `openhosti_jax.pipeline`, `openhosti_jax.balance`,
`openhosti_jax.bridges` (PyTorch / TensorFlow, imported lazily), `openhosti_jax.report`.
"""

from openhosti_jax import errors
from openhosti_jax.checkpoint import CheckpointManager, run_with_restarts
from openhosti_jax.data import ArrayDataset
from openhosti_jax.mesh import MeshConfig, build_mesh, initialize_distributed
from openhosti_jax.microbatch import accumulate_gradients, find_microbatch, make_train_step
from openhosti_jax.planner import ShardingPlan, plan
from openhosti_jax.state import TrainState, create_train_state
from openhosti_jax.train import Trainer, TrainerCheckpoint, spmd

__version__ = "0.1.0"

__all__ = [
    "ArrayDataset",
    "CheckpointManager",
    "MeshConfig",
    "ShardingPlan",
    "TrainState",
    "Trainer",
    "TrainerCheckpoint",
    "accumulate_gradients",
    "build_mesh",
    "create_train_state",
    "errors",
    "find_microbatch",
    "initialize_distributed",
    "make_train_step",
    "plan",
    "run_with_restarts",
    "spmd",
]
