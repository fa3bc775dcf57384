"""@spmd on steps of any signature: typed errors for arguments it cannot take, parameters it cannot find, graph
objects returned or nested, a state the step does not give back, and the non-finite guard on graph objects."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import openhosti_jax as oh
from openhosti_jax.errors import StateError, StepArgumentError, StepOutputError


def mesh():
    return oh.build_mesh(oh.MeshConfig(data=8))


def params_and_data(tx):
    params = {"w": jnp.full((16, 256), 0.01), "v": jnp.full((256, 1), 0.01)}
    x = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
    return params, tx.init(params), x


def loss(params, x):
    return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - 1.0) ** 2)


def optax_step(tx):
    def step(params, opt_state, x, *extra):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def test_an_argument_that_is_neither_a_pytree_nor_a_graph_object_is_a_typed_error():
    tx = optax.adam(0.1)
    params, opt_state, x = params_and_data(tx)
    step = oh.spmd(optax_step(tx), mesh=mesh(), plan="dp")
    with pytest.raises(StepArgumentError, match=r"step argument args\[3\]\['mode'\]: expected a pytree of arrays"):
        step(params, opt_state, x, {"mode": "train"})
    with pytest.raises(TypeError, match=r"found builtins\.str; pass it as a static argument.*static_argnums"):
        step(params, opt_state, x, "train")
    with pytest.raises(StepArgumentError, match=r"static step argument args\[3\]: expected a hashable value"):
        oh.spmd(optax_step(tx), mesh=mesh(), plan="dp", static_argnums=3)(params, opt_state, x, ["train"])
    *_, value = oh.spmd(optax_step(tx), mesh=mesh(), plan="dp", static_argnums=-1)(params, opt_state, x, "train")
    assert np.isfinite(float(value))


def test_parameters_that_cannot_be_told_from_the_data_name_the_params_override():
    tx = optax.sgd(0.1)  # no state mirrors the parameters: they look like any other floating argument
    params, opt_state, x = params_and_data(tx)
    step = oh.spmd(optax_step(tx), mesh=oh.build_mesh(oh.MeshConfig(data=2, fsdp=4)), plan="fsdp")
    with pytest.raises(StateError, match=r"found floating-point leaves in args\[0\], args\[2\].*params='0'"):
        step(params, opt_state, x, jax.random.key(0))
    step = oh.spmd(optax_step(tx), mesh=oh.build_mesh(oh.MeshConfig(data=2, fsdp=4)), plan="fsdp", params="0")
    first = None
    for _ in range(3):
        params, opt_state, value = step(params, opt_state, x, jax.random.key(0))
        first = first or float(value)
    assert float(value) < first
    assert params["w"].sharding.spec == jax.P(None, ("data", "fsdp"))


def test_flax_getting_started_step_returning_the_state_alone_runs_as_jax_jit_would():
    def make():
        return train_state.TrainState.create(
            apply_fn=None, params=params_and_data(optax.adam(0.1))[0], tx=optax.adam(0.01)
        )

    def train_step(state, x):
        grads = jax.grad(loss)(state.params, x)
        return state.apply_gradients(grads=grads)

    x = params_and_data(optax.adam(0.1))[2]
    ref, ours = make(), make()
    step = oh.spmd(train_step, mesh=mesh(), plan="zero1")
    for _ in range(3):
        ref, ours = jax.jit(train_step)(ref, x), step(ours, x)
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(ours.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert int(ours.step) == 3 and ours.opt_state[0].mu["w"].sharding.spec == jax.P(None, "data")
    with pytest.raises(StepOutputError, match=r"must return \(new_state, metrics\)"):  # its state is not in it
        oh.spmd(lambda s, b: s.params, mesh=mesh(), plan="dp")(make(), x)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 256, rngs=rngs)
        self.down = nnx.Linear(256, 1, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def nnx_loss(model, x):
    return jnp.mean((model(x) - 1.0) ** 2)


def test_graph_objects_nested_passed_by_keyword_and_returned_are_the_callers_own():
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = params_and_data(optax.adam(0.1))[2]

    @oh.spmd(mesh=mesh(), plan="fsdp")
    def step(pair, *, batch):
        model, optimizer = pair
        value, grads = nnx.value_and_grad(nnx_loss)(model, batch)
        optimizer.update(model, grads)
        return {"loss": value, "model": model}

    before = np.asarray(model.up.kernel[...])
    out = step((model, optimizer), batch=x)
    assert out["model"] is model and np.isfinite(float(out["loss"]))
    assert not np.allclose(before, np.asarray(model.up.kernel[...]))  # updated in place
    assert step.layout.describe(oh.state.call.arg_path) == (
        "parameters at args[0][0], optimizer state at args[0][1]['opt_state']"
    )

    @oh.spmd(mesh=mesh(), plan="fsdp")
    def fresh(model, x):
        return nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    with pytest.raises(StepArgumentError, match="the step returned a new Linear"):
        fresh(model, x)


def test_a_state_argument_the_step_does_not_return_is_not_donated():
    tx = optax.adam(0.1)
    params, opt_state, x = params_and_data(tx)

    @oh.spmd(mesh=mesh(), plan="dp")
    def evaluate(params, opt_state, x):
        return loss(params, x)

    value = evaluate(params, opt_state, x)
    np.testing.assert_allclose(float(value), float(loss(params, x)), rtol=1e-6)
    assert float(jnp.sum(params["w"])) > 0  # still alive: not donated
    assert any("state not donated: the step does not return args[0], args[1]" in e for e in evaluate.report.events)


def test_a_non_finite_step_leaves_graph_objects_as_they_were():
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @oh.spmd(mesh=mesh(), plan="dp")
    def step(model, optimizer, x):
        value, grads = nnx.value_and_grad(nnx_loss)(model, x)
        optimizer.update(model, grads)
        return value

    x = params_and_data(optax.adam(0.1))[2]
    step(model, optimizer, x)
    kept = jax.tree.map(np.asarray, nnx.state(model))
    assert not np.isfinite(float(step(model, optimizer, np.full_like(x, np.nan))))
    assert int(step.skipped_nonfinite) == 1 and int(optimizer.step[...]) == 1
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(a, b)
    step(model, optimizer, x)
    assert int(step.skipped_nonfinite) == 0 and int(optimizer.step[...]) == 2
