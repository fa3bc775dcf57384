"""Every state type trains through `Trainer.fit`, checkpoints, resumes bit for bit, and restores onto another mesh."""

import jax
import numpy as np
import optax
import pytest
import test_linen_cnn
import test_nnx_model
import test_plain_pytree
from _harness import assert_close_trees

import openhosti_jax as oh


def sgd_state():
    params = test_plain_pytree.make_state()[0]
    return params, optax.sgd(0.1).init(params)  # a stateless optimizer: no step counter anywhere


def sgd_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(test_plain_pytree.loss)(params, batch)
    return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), opt_state), {"loss": loss}


CASES = {
    "plain_adam": (test_plain_pytree.make_state, test_plain_pytree.step, test_plain_pytree.batch),
    "plain_sgd": (sgd_state, sgd_step, test_plain_pytree.batch),
    "linen_train_state": (test_linen_cnn.make_state, test_linen_cnn.step, test_linen_cnn.batch),
    "nnx_split": (test_nnx_model.make_state, test_nnx_model.step, test_nnx_model.batch),
}


def fit(case, num_steps, mesh_config, directory=None):
    make, step, batch = CASES[case]
    data = oh.ArrayDataset({k: np.concatenate([v] * 4) for k, v in batch().items()}, 32, seed=3)
    mesh = oh.build_mesh(mesh_config)
    ckpt = oh.TrainerCheckpoint(directory, every_steps=2) if directory else None
    trainer = oh.Trainer(oh.spmd(step, mesh=mesh, plan="fsdp"), progress=False, checkpoint=ckpt)
    return trainer.fit(make(), data, num_steps), ckpt


def exact(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # 35 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_resumes_bit_for_bit_and_onto_another_mesh(case, tmp_path):
    here, there = oh.MeshConfig(data=2, fsdp=4), oh.MeshConfig(data=8, fsdp=1)
    straight, _ = fit(case, 4, here)
    for run in ("same", "moved"):
        first, ckpt = fit(case, 2, here, tmp_path / run)
        assert len(first.history) == 2 and ckpt.manager.good_steps() == [2]
    resumed, ckpt = fit(case, 4, here, tmp_path / "same")
    assert ckpt.resumed_from == 2 and [h["step"] for h in resumed.history] == [3, 4]
    exact(straight.state, resumed.state)  # bit for bit
    moved, ckpt = fit(case, 4, there, tmp_path / "moved")  # restored onto a data=8 mesh, steps 3 and 4 there
    assert ckpt.resumed_from == 2 and [h["step"] for h in moved.history] == [3, 4]
    assert_close_trees(straight.state, moved.state, rtol=1e-4, atol=1e-5)
