"""Sharded TrainState creation: shards really are 1/N, values equal an unsharded init, linen and nnx."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from openhosti_jax import MeshConfig, build_mesh, create_train_state
from openhosti_jax.errors import ShardingError, StateError
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.sharding import ShardingPlan


def _gpt(r):
    return GPT(GPTConfig.tiny(), rngs=nnx.Rngs(r))


def test_fsdp_leaves_are_sharded_one_eighth_along_the_chosen_dim():
    mesh = build_mesh(MeshConfig(data=1, fsdp=8))
    state, plan = create_train_state(_gpt, optax.adam(1e-3), mesh, plan="fsdp")
    checked = 0
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    specs = jax.tree.leaves(plan.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, x), spec in zip(leaves, specs, strict=True):
        dims = [d for d, e in enumerate(spec) if e is not None]
        for shard in x.addressable_shards:
            expect = list(x.shape)
            for d in dims:
                expect[d] //= 8
            assert shard.data.shape == tuple(expect), jax.tree_util.keystr(path)
        if x.size >= 4096:
            assert len(dims) == 1, f"{jax.tree_util.keystr(path)} of shape {x.shape} should be sharded"
            checked += 1
    assert checked >= 8
    # optimizer moments follow their parameters
    mu = state.opt_state[0].mu
    assert mu["head"]["kernel"][...].sharding.spec == state.params["head"]["kernel"][...].sharding.spec


@pytest.mark.slow  # 6 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_sharded_init_equals_single_device_init():
    mesh8 = build_mesh(MeshConfig(data=1, fsdp=8))
    mesh1 = build_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    s8, _ = create_train_state(_gpt, optax.adam(1e-3), mesh8, plan="fsdp", seed=3)
    s1, _ = create_train_state(_gpt, optax.adam(1e-3), mesh1, plan="dp", seed=3)
    for a, b in zip(jax.tree.leaves(s8.params), jax.tree.leaves(s1.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_linen_state_and_apply_fn():
    model = nn.Sequential([nn.Dense(256), nn.relu, nn.Dense(64)])
    mesh = build_mesh(MeshConfig(data=2, fsdp=4))
    x = jnp.ones((4, 64))
    state, plan = create_train_state(
        lambda r: model.init(r, x)["params"], optax.sgd(0.1), mesh, apply_fn=model.apply, plan="zero1"
    )
    assert plan.zero_stage == 1
    y = state.apply_fn({"params": state.params}, x)
    ref = model.apply({"params": jax.device_get(state.params)}, np.asarray(x))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6)


def test_bad_strategy_and_bad_spec_are_typed_errors():
    mesh = build_mesh(MeshConfig(data=-1))
    with pytest.raises(StateError, match="unknown sharding strategy"):
        create_train_state(lambda r: {"w": jnp.ones((8, 8))}, optax.sgd(0.1), mesh, plan="zero9")
    params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    bad = ShardingPlan(
        {"data": 8, "fsdp": 1},
        {"w": jax.sharding.PartitionSpec("model", None)},
        {"w": jax.sharding.PartitionSpec()},
        None,
    )
    with pytest.raises(ShardingError, match="unknown mesh axis 'model'"):
        bad.validate(params)
    indivisible = ShardingPlan(
        {"data": 8, "fsdp": 1},
        {"w": jax.sharding.PartitionSpec("data")},
        {"w": jax.sharding.PartitionSpec()},
        None,
    )
    with pytest.raises(ShardingError, match="not divisible by 8"):
        indivisible.validate({"w": jax.ShapeDtypeStruct((12,), jnp.float32)})
    with pytest.raises(StateError, match="init_fn"):
        create_train_state(lambda r: undefined_name, optax.sgd(0.1), mesh)  # noqa: F821


def test_created_state_unpacks_as_state_and_plan_and_keeps_the_planners_report():
    """``state, plan = create_train_state(...)`` still unpacks; ``.report`` is the planner's where it planned (the
    ranked candidates of ``"auto"``, the stage a strategy name maps to) and None for a given `ShardingPlan`."""
    import pickle

    from openhosti_jax.sharding import PlanReport
    from openhosti_jax.train import CreatedState
    from openhosti_jax.train.create import resolve_plan

    mesh = build_mesh(MeshConfig(data=2, fsdp=4))
    init = lambda r: {"w": jax.random.normal(r, (64, 64)), "b": jnp.zeros((64,))}  # noqa: E731
    tx = optax.adam(1e-3)

    auto = create_train_state(init, tx, mesh, plan="auto")
    assert isinstance(auto, CreatedState) and isinstance(auto, tuple) and len(auto) == 2
    state, plan = auto
    assert state is auto.state and plan is auto.plan and auto[0] is state and auto[1] is plan
    assert isinstance(auto.report, PlanReport) and auto.report.plan is plan
    # the planner's reasons: its ranked candidates, the winner first, and its prediction
    assert len(auto.report.candidates) > 1 and auto.report.predicted_bytes is not None
    assert auto.report.candidates[0].label in str(auto.report)

    named = create_train_state(init, tx, mesh, plan="zero1")
    assert named.plan.zero_stage == 1 and named.report.plan is named.plan
    assert named.report.notes == resolve_plan("zero1", jax.eval_shape(init, jax.random.key(0)), tx, mesh)[1].notes

    given = create_train_state(init, tx, mesh, plan=named.plan)
    assert given.report is None and given.plan is named.plan
    np.testing.assert_array_equal(np.asarray(given.state.params["w"]), np.asarray(named.state.params["w"]))

    copied = pickle.loads(pickle.dumps(CreatedState("state", "plan", "report")))  # pickles with its report
    assert copied == ("state", "plan") and copied.report == "report" and isinstance(copied, CreatedState)
