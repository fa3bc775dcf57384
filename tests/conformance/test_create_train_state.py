"""Mutable model state through `create_train_state` + ``@spmd``: an nnx model's BatchNorm statistics and Dropout RNG
counts, and a linen model's ``batch_stats``, come back in the new state, match one device, and resume bit for bit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _harness import STEPS, TOLERANCE, assert_close_trees, losses_of
from flax import nnx
from test_nnx_model import Net
from test_resume import exact

import openhosti_jax as oh

TX = optax.sgd(0.05, momentum=0.9)


def nnx_init(rng):
    return Net(nnx.Rngs(rng, dropout=1))


def nnx_step(state, batch):
    def loss_fn(params):
        logits, model_state = state.apply_fn(params, batch["x"], model_state=state.model_state, mutable=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), model_state

    (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(model_state=model_state), {"loss": loss}


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(512)(x)))
        return nn.Dense(4)(nn.Dropout(0.2, deterministic=not train)(x))


def linen_init(rng):
    return CNN().init(rng, jnp.ones((1, 16)), train=False)  # params and batch_stats


def linen_step(state, batch):
    state, key = state.next_rng()

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, **state.model_state},
            batch["x"],
            train=True,
            mutable=["batch_stats"],
            rngs={"dropout": key},
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(model_state=updates), {"loss": loss}


CASES = {"nnx": (nnx_init, None, nnx_step), "linen": (linen_init, CNN().apply, linen_step)}


def batch():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.integers(0, 4, 32).astype(np.int32)}


def stats(state):
    return (
        state.model_state["bn"]["mean"][...]
        if isinstance(state.model_state, nnx.State)
        else (state.model_state["batch_stats"]["BatchNorm_0"]["mean"])
    )


@pytest.mark.slow  # 19 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["auto", "fsdp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mutable_model_state_comes_back_and_matches_one_device(case, plan):
    init_fn, apply_fn, step = CASES[case]
    one = oh.build_mesh(oh.MeshConfig(data=1), devices=jax.devices()[:1])
    ref_state, _ = oh.create_train_state(init_fn, TX, one, plan="dp", apply_fn=apply_fn)
    reference, ref_state = losses_of(jax.jit(step), ref_state, jax.device_put(batch(), jax.devices()[0]))
    mesh = oh.build_mesh(oh.MeshConfig(data=2, fsdp=4))
    state, the_plan = oh.create_train_state(init_fn, TX, mesh, plan="fsdp", apply_fn=apply_fn)
    ours, state = losses_of(oh.spmd(step, mesh=mesh, plan=the_plan if plan == "fsdp" else "auto"), state, batch())
    np.testing.assert_allclose(ours, reference, rtol=TOLERANCE)
    assert ours[-1] < ours[0] and len(ours) == STEPS
    initial, _ = oh.create_train_state(init_fn, TX, one, plan="dp", apply_fn=apply_fn)
    assert not np.allclose(np.asarray(stats(state)), np.asarray(stats(initial)))  # the statistics moved
    assert_close_trees(ref_state.model_state, state.model_state)  # and alike, RNG counts exactly


@pytest.mark.slow  # 17 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_mutable_model_state_resumes_bit_for_bit(case, tmp_path):
    init_fn, apply_fn, step = CASES[case]
    mesh = oh.build_mesh(oh.MeshConfig(data=2, fsdp=4))

    def fit(num_steps, directory=None):
        state, plan = oh.create_train_state(init_fn, TX, mesh, plan="fsdp", apply_fn=apply_fn)
        data = oh.ArrayDataset({k: np.concatenate([v] * 4) for k, v in batch().items()}, 32, seed=3)
        ckpt = oh.TrainerCheckpoint(directory, every_steps=2) if directory else None
        trainer = oh.Trainer(oh.spmd(step, mesh=mesh, plan=plan), progress=False, checkpoint=ckpt)
        return trainer.fit(state, data, num_steps).state

    straight = fit(4)
    fit(2, tmp_path / "run")
    exact(straight, fit(4, tmp_path / "run"))
