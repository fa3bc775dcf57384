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
