"""Kinds of step arguments besides pytrees of arrays (`openhosti_jax.state.kinds`): equinox modules split into
arrays and a static rest as ``eqx.filter_jit`` does, an unknown kind named with the kinds known and how to register
one, and a registered kind run end to end. Numbers are checked against the same step under jit on one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import openhosti_jax as oh
from openhosti_jax.errors import ConfigError, StepArgumentError
from openhosti_jax.state.call import bind, call_layout
from openhosti_jax.state.kinds import StateKind, register_kind, unregister_kind
from openhosti_jax.state.model import abstract

eqx = pytest.importorskip("equinox")


def mesh():
    return oh.build_mesh(oh.MeshConfig(data=8))


def mlp():
    return eqx.nn.MLP(4, 2, width_size=8, depth=1, activation=jax.nn.relu, key=jax.random.PRNGKey(0))


def data():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(16, 4)).astype(np.float32), "y": rng.normal(size=(16, 2)).astype(np.float32)}


tx = optax.adam(1e-2)


def pair_step(state, batch):
    """The issue's form: ``step((model, opt_state), batch) -> ((model, opt_state), metrics)``."""
    model, opt_state = state

    def loss(m):
        return jnp.mean((jax.vmap(m)(batch["x"]) - batch["y"]) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), {"loss": value}


def test_abstract_keeps_a_modules_activation_functions_instead_of_raising():
    """``abstract`` called ``jnp.result_type`` on ``eqx.nn.MLP``'s ``activation`` and raised a raw TypeError."""
    shapes = abstract(mlp())
    assert shapes.activation is jax.nn.relu and shapes.layers[0].weight == jax.ShapeDtypeStruct((8, 4), jnp.float32)


def test_an_equinox_module_binds_as_its_arrays_and_its_functions_key_the_compiled_step():
    model = mlp()
    call = bind(((model, tx.init(eqx.filter(model, eqx.is_array))), data()), {})
    assert all(isinstance(x, jax.Array | np.ndarray) for x in jax.tree.leaves(call.view))  # no function there
    layout, keys = call_layout(call)
    assert keys == ("0",) and layout.describe() == "parameters at state['0'][0], optimizer state at state['0'][1]"
    (rebuilt, _), _ = call.arguments(call.view)[0]
    assert rebuilt.activation is jax.nn.relu and rebuilt.layers[1].weight is model.layers[1].weight
    tanh = eqx.tree_at(lambda m: m.activation, model, jax.nn.tanh)
    other = bind(((tanh, tx.init(eqx.filter(model, eqx.is_array))), data()), {})
    assert other.key() != call.key()  # another activation: another compiled step, as eqx.filter_jit would


def test_an_equinox_state_batch_step_matches_filter_jit_on_one_device():
    with jax.default_device(jax.devices()[0]):
        model = mlp()
        state = (model, tx.init(eqx.filter(model, eqx.is_array)))
        ref = eqx.filter_jit(pair_step)
        ref_losses = []
        for _ in range(3):
            state, m = ref(state, data())
            ref_losses.append(float(m["loss"]))
    ours_state = (mlp(), tx.init(eqx.filter(mlp(), eqx.is_array)))
    step = oh.spmd(pair_step, mesh=mesh(), plan="dp")
    losses = []
    for _ in range(3):
        ours_state, m = step(ours_state, data())
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    ours = ours_state[0]
    assert isinstance(ours, eqx.nn.MLP) and ours.activation is jax.nn.relu
    ours_arrays, ref_arrays = eqx.filter(ours, eqx.is_array), eqx.filter(state[0], eqx.is_array)
    for a, b in zip(jax.tree.leaves(ours_arrays), jax.tree.leaves(ref_arrays), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@dataclasses.dataclass
class Scaled:
    """Not a pytree: a weight and the function applied to it."""

    w: jax.Array
    fn: object


def test_an_unknown_kind_is_named_with_every_bad_leaf_the_kinds_known_and_how_to_register_one():
    step = oh.spmd(lambda s, x, f: (s, jnp.sum(x)), mesh=mesh(), plan="dp")
    with pytest.raises(StepArgumentError) as err:
        step({"w": jnp.ones(2)}, {"s": Scaled(jnp.ones(2), abs)}, jax.nn.relu)
    text = str(err.value)
    assert "step argument args[1]['s']: expected a pytree of arrays" in text and "test_state_kinds.Scaled;" in text
    assert "register its kind (openhosti_jax.state.kinds.register_kind)" in text
    assert "step argument args[2]: " in text and "close over it in the step, or keep it in an equinox Module" in text
    for kind in ("nnx graph objects", "equinox module", "flax's TrainState"):
        assert kind in text.split("The kinds a step argument may be:")[1], kind
    two = oh.spmd(lambda s, b: (s, {"loss": jnp.sum(b["x"])}), mesh=mesh(), plan="dp")  # the (state, batch) form
    with pytest.raises(StepArgumentError, match=r"step argument args\[0\]\['s'\]: .* found .*Scaled"):
        two({"w": jnp.ones(2), "s": Scaled(jnp.ones(2), abs)}, data())


def test_a_registered_kind_runs_through_spmd_and_equals_jit_with_its_split_and_merge():
    kind = StateKind(
        "scaled",
        lambda x: isinstance(x, Scaled),
        lambda x: ({"w": x.w}, x.fn),
        lambda arrays, fn: Scaled(arrays["w"], fn),
    )
    register_kind(kind)
    try:
        with pytest.raises(ConfigError, match="a state kind named 'scaled' is registered already"):
            register_kind(kind)
        sgd = optax.sgd(0.1)

        def step(s, opt_state, x):
            value, g = jax.value_and_grad(lambda w: jnp.sum(s.fn(x @ w)))(s.w)
            updates, opt_state = sgd.update(g, opt_state)
            return Scaled(s.w + updates, s.fn), opt_state, value

        x = np.ones((8, 4), np.float32)
        start = lambda: Scaled(jnp.full((4, 2), 0.5), jnp.tanh)  # noqa: E731
        ref_w, _, ref_v = step(start(), sgd.init(start().w), x)
        new, _, value = oh.spmd(step, mesh=mesh(), plan="dp", params="0")(start(), sgd.init(start().w), x)
        assert isinstance(new, Scaled) and new.fn is jnp.tanh
        np.testing.assert_allclose(np.asarray(new.w), np.asarray(ref_w.w), rtol=1e-6)
        np.testing.assert_allclose(float(value), float(ref_v), rtol=1e-6)
    finally:
        unregister_kind("scaled")
