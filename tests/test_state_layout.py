"""find_layout locates parameters and optimizer state in any pytree; bad states and bad steps get typed errors
naming the pytree path and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import openhosti_jax as oh
from openhosti_jax.errors import StateError
from openhosti_jax.sharding import ShardingPlan
from openhosti_jax.state import state_specs
from openhosti_jax.state.layout import find_layout

PARAMS = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}


@pytest.mark.parametrize("name", ["adam", "adamw", "lion", "sgd_momentum"])
def test_tuples_and_dicts_in_either_order(name):
    tx = {
        "adam": optax.adam(1e-3),
        "adamw": optax.adamw(1e-3),
        "lion": optax.lion(1e-3),
        "sgd_momentum": optax.sgd(0.1, momentum=0.9),
    }[name]
    opt = tx.init(PARAMS)
    assert find_layout((PARAMS, opt)).describe() == "parameters at state[0], optimizer state at state[1]"
    assert find_layout({"m": PARAMS, "o": opt}).describe() == "parameters at state['m'], optimizer state at state['o']"
    if name != "sgd_momentum":  # two moments (Adam) or a step counter (Lion) tell the optimizer's side in any order;
        # a lone momentum is the parameters' twin, and (params, opt_state) is the order that decides
        assert find_layout((opt, PARAMS)).describe() == "parameters at state[1], optimizer state at state[0]"


def test_named_fields_stateless_optimizers_and_look_alike_layers():
    ts = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.adam(1e-3))
    assert find_layout(ts).describe() == "parameters at state.params, optimizer state at state.opt_state"
    plain_sgd = (PARAMS, optax.sgd(0.1).init(PARAMS), jnp.int32(0))
    assert find_layout(plain_sgd).describe() == "parameters at state[0], no optimizer state"
    layers = {f"layer{i}": {"k": jnp.ones((8, 8))} for i in range(4)}  # layer 1 is no optimizer moment of layer 0
    assert find_layout(layers).describe() == "parameters at state, no optimizer state"


def test_nnx_parameters_are_what_the_optimizer_mirrors():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.bn = nnx.Linear(4, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs)

    model = Net(nnx.Rngs(0))
    _, state = nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))
    layout = find_layout(state)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(layout.params(state))[0]]
    assert names == [
        "['bn']['bias'].value",
        "['bn']['scale'].value",
        "['lin']['bias'].value",
        "['lin']['kernel'].value",
    ]


def test_specs_place_mirrors_like_their_parameter_and_the_rest_replicated():
    state = {"params": PARAMS, "opt_state": optax.adam(1e-3).init(PARAMS), "ema": PARAMS, "step": jnp.int32(0)}
    layout = find_layout(state)
    plan = ShardingPlan.from_zero(layout.params(state), layout.opt_state(state), {"fsdp": 8}, 3)
    specs = state_specs(plan, state, layout)
    assert specs["params"]["w"] == specs["ema"]["w"] == specs["opt_state"][0].mu["w"] == P("fsdp", None)
    assert specs["step"] == P() and specs["opt_state"][0].count == P()
    stage1 = ShardingPlan.from_zero(layout.params(state), optax.adam(1e-3), {"fsdp": 8}, 1)
    specs = state_specs(stage1, state, layout)
    assert specs["params"]["w"] == P(None, None) and specs["opt_state"][0].nu["w"] == P("fsdp", None)


def test_overrides_and_their_errors():
    odd = {"weights": PARAMS, "aux": {"momentum": optax.sgd(0.1, momentum=0.9).init(PARAMS)}}
    layout = find_layout(odd, params="weights", opt_state="aux")
    assert layout.describe() == "parameters at state['weights'], optimizer state at state['aux']"
    with pytest.raises(StateError, match=r"params='wieghts' names no node of the state; expected a dotted path"):
        find_layout(odd, params="wieghts")
    with pytest.raises(StateError, match=r"opt_state='nope' names no node"):
        find_layout(odd, params="weights", opt_state="nope")


def test_a_state_with_nothing_to_train():
    with pytest.raises(StateError, match="no floating-point leaves to train .*found Array"):
        find_layout({"step": jnp.int32(0), "tokens": jnp.zeros(3, jnp.int32)})


def _sgd_step(state, batch):
    params, opt = state
    grads = jax.grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(params)
    return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), opt), {"loss": jnp.float32(0.0)}


def _run(step, state=None, **kw):
    mesh = oh.build_mesh(oh.MeshConfig(data=8))
    return oh.spmd(step, mesh=mesh, plan="dp", **kw)(state or ({"w": jnp.ones((4, 4))}, ()), jnp.ones((16, 4)))


def test_steps_that_change_the_state_or_return_bad_metrics():
    with pytest.raises(StateError, match="another structure than it took"):
        _run(lambda s, b: ((s[0], s[0]), {}))
    with pytest.raises(StateError, match=r"state\[0\]\['w'\]: took \(4, 4\) float32, returned \(4, 4\) float16"):
        _run(lambda s, b: (({"w": s[0]["w"].astype(jnp.float16)}, ()), {}))
    with pytest.raises(StateError, match=r"metrics\['per_row'\]: shape \(16,\).*reduce it"):
        _run(lambda s, b: (s, {"per_row": jnp.sum(b, axis=1)}))
    with pytest.raises(StateError, match="must return \\(new_state, metrics\\)"):
        _run(lambda s, b: s[0])
    state, metrics = _run(_sgd_step)
    assert np.isfinite(float(metrics["loss"]))


def test_microbatch_on_a_step_that_does_not_accumulate_is_refused():
    with pytest.raises(StateError, match="never asks for them.*make_train_step"):
        _run(_sgd_step, microbatch=2)
