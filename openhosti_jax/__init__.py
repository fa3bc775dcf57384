"""openhosti_jax: JAX-first SPMD training. See README.md for the quick start.

Subpackages not re-exported here (import them by name): `openhosti_jax.pipeline`, `openhosti_jax.balance`,
`openhosti_jax.bridges` (PyTorch / TensorFlow plumbing, imported lazily), `openhosti_jax.frontends` (the doors for
other frameworks: `OptimizedDDP` below, and `openhosti_jax.frontends.keras.Strategy`), `openhosti_jax.report`,
`openhosti_jax.models` (pure model code) and `openhosti_jax.demo` (the bundled demo job).
"""

from openhosti_jax import errors
from openhosti_jax.checkpoint import CheckpointManager, run_with_restarts
from openhosti_jax.data import ArrayDataset
from openhosti_jax.mesh import MeshConfig, build_mesh, initialize_distributed
from openhosti_jax.microbatch import accumulate_gradients, find_microbatch, make_train_step
from openhosti_jax.planner import choose_plan
from openhosti_jax.sharding import PlanReport, ShardingPlan, place_batch
from openhosti_jax.state import TrainState
from openhosti_jax.train import (
    LossSpikePolicy,
    Trainer,
    TrainerCheckpoint,
    balanced_step,
    create_train_state,
    pipeline_step,
    spmd,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``OptimizedDDP`` on first use: it imports torch, which ``import openhosti_jax`` does not."""
    if name == "OptimizedDDP":
        from openhosti_jax.frontends.torch_ddp import OptimizedDDP

        return OptimizedDDP
    raise AttributeError(f"module 'openhosti_jax' has no attribute {name!r}")


__all__ = [
    "ArrayDataset",
    "CheckpointManager",
    "LossSpikePolicy",
    "MeshConfig",
    "PlanReport",
    "ShardingPlan",
    "TrainState",
    "Trainer",
    "TrainerCheckpoint",
    "accumulate_gradients",
    "balanced_step",
    "build_mesh",
    "choose_plan",
    "create_train_state",
    "errors",
    "find_microbatch",
    "initialize_distributed",
    "make_train_step",
    "pipeline_step",
    "place_batch",
    "run_with_restarts",
    "spmd",
]
