"""The parts of `openhosti_jax.frontends.keras` that need neither Keras nor TensorFlow, in the fast suite: the planner's
choice for Keras variables, the InputContext arithmetic, the save schedule's units and the batch divisibility
rule that sends a partial batch to a replicated layout."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import BatchError, ConfigError, MemoryBudgetError, PlanningError
from openhosti_jax.frontends.keras import InputContext
from openhosti_jax.frontends.keras._backend import batch_divides
from openhosti_jax.frontends.keras.auto import layout_for, plan_variables, spec_axes, stand_in_optimizer
from openhosti_jax.frontends.keras.checkpoint import save_minutes
from openhosti_jax.mesh import MeshConfig, build_mesh

PARAMS = {
    "mlp/dense/kernel": jax.ShapeDtypeStruct((32, 4096), jnp.float32),
    "mlp/dense/bias": jax.ShapeDtypeStruct((4096,), jnp.float32),
    "mlp/dense_1/kernel": jax.ShapeDtypeStruct((4096, 10), jnp.float32),
}


def test_planner_shards_keras_variables_only_when_the_budget_asks():
    devices = jax.devices()
    free, report = plan_variables(PARAMS, devices, slots=2, global_batch=8, device_profile="H100")
    assert free.zero_stage == 0 and report.plan is free
    assert all(spec_axes(s, 2) == (None, None) for s in free.param_specs.values())
    tight, report = plan_variables(
        PARAMS, devices, slots=2, global_batch=8, device_profile="H100", memory_budget=1_500_000
    )
    assert tight.zero_stage == 3 and tight.mesh_shape["fsdp"] > 1
    assert report.predicted_bytes <= 1_500_000 and any("memory budget: given" in n for n in report.notes)
    kernel = spec_axes(tight.param_specs["mlp/dense/kernel"], 2)
    assert any(a is not None for a in kernel)  # the big kernel is split
    # a variable made after planning (a metric, a loaded model) follows the plan's ZeRO rule
    assert any(a is not None for a in layout_for(tight, (4096, 4096), jnp.float32))
    assert layout_for(free, (4096, 4096), jnp.float32) == (None, None)
    fixed, _ = plan_variables(
        PARAMS, devices, slots=2, global_batch=8, device_profile="H100", mesh_shape=tight.mesh_shape
    )
    assert dict(fixed.mesh_shape) == dict(tight.mesh_shape)  # a later model is planned on the first one's mesh
    with pytest.raises(MemoryBudgetError):
        plan_variables(PARAMS, devices, slots=2, global_batch=8, device_profile="H100", memory_budget=1000)
    with pytest.raises(PlanningError, match="no trainable variables"):
        plan_variables({}, devices, slots=2, global_batch=8, device_profile="H100")


def test_slots_are_priced():
    state = stand_in_optimizer(3).init({"w": jnp.ones((4, 2))})
    assert len(state) == 3 and state[0]["w"].shape == (4, 2)
    _, none = plan_variables(PARAMS, jax.devices(), slots=0, global_batch=8, device_profile="H100")
    _, four = plan_variables(PARAMS, jax.devices(), slots=4, global_batch=8, device_profile="H100")
    assert four.predicted_bytes > none.predicted_bytes


def test_input_context_as_tf_distribute_defines_it():
    context = InputContext(2, 1, 8)
    assert (context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync) == (2, 1, 8)
    assert context.get_per_replica_batch_size(64) == 8 and context.per_replica_batch_size == 8
    with pytest.raises(BatchError, match="not divisible by num_replicas_in_sync 8"):
        context.get_per_replica_batch_size(60)


def test_save_schedule_units():
    assert save_minutes(30, None) == 0.5 and save_minutes(None, 2.0) == 2.0 and save_minutes(None, None) is None
    with pytest.raises(ConfigError, match="not both"):
        save_minutes(1, 1)
    with pytest.raises(ConfigError, match="every_seconds > 0"):
        save_minutes(0, None)


def test_partial_batches_are_the_ones_that_do_not_divide():
    mesh = build_mesh(MeshConfig(data=2, fsdp=4))
    split = NamedSharding(mesh, P(("data", "fsdp")))
    assert batch_divides((64, 3), split) and not batch_divides((60, 3), split)
    assert batch_divides((6, 3), NamedSharding(mesh, P("data"))) and not batch_divides(
        (5,), NamedSharding(mesh, P("data"))
    )
    assert batch_divides((5, 3), NamedSharding(mesh, P())) and batch_divides((), split)
