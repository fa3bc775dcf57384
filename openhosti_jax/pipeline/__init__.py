"""Pipeline parallelism: layer costs, exact stage cuts, schedules as data, a simulator, an SPMD executor.

Example:
    >>> from openhosti_jax.pipeline import gpipe, simulate
    >>> round(simulate(gpipe(4, 4), 1.0).bubble_fraction, 3)
    0.429
"""

from openhosti_jax.pipeline.costs import LayerCost, layer_costs, split_modules
from openhosti_jax.pipeline.executor import make_pipeline_step, pipeline_value_and_grad
from openhosti_jax.pipeline.packing import Packing
from openhosti_jax.pipeline.partitioner import (
    StageCostModel,
    StagePartition,
    evaluate_partition,
    objective_value,
    partition,
)
from openhosti_jax.pipeline.schedule import (
    Action,
    Schedule,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
)
from openhosti_jax.pipeline.simulator import SimResult, simulate
from openhosti_jax.pipeline.split import LayerSequence, split_layers
from openhosti_jax.pipeline.state import (
    PipelineState,
    init_pipeline_state,
    make_pipeline_train_step,
    pack_state,
    unpack_state,
)
from openhosti_jax.pipeline.ticks import TickTable, tick_table

__all__ = [
    "Action",
    "LayerCost",
    "LayerSequence",
    "Packing",
    "PipelineState",
    "Schedule",
    "SimResult",
    "StageCostModel",
    "StagePartition",
    "TickTable",
    "evaluate_partition",
    "init_pipeline_state",
    "gpipe",
    "interleaved_one_f_one_b",
    "layer_costs",
    "make_pipeline_step",
    "make_pipeline_train_step",
    "make_schedule",
    "objective_value",
    "one_f_one_b",
    "pack_state",
    "partition",
    "pipeline_value_and_grad",
    "simulate",
    "split_layers",
    "split_modules",
    "tick_table",
    "unpack_state",
]
