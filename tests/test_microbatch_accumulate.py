"""Accumulated gradients over k microbatches equal the full-batch gradient (single-device reference)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import BatchError, ShardingError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.microbatch import accumulate_gradients, make_train_step, microbatch_layout
from openhosti_jax.state import TrainState

W = 16


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (8, W)) / 3,
        "b1": jnp.zeros((W,)),
        "w2": jax.random.normal(k2, (W, W)) / 4,
        "out": jax.random.normal(k3, (W, 1)) / 4,
    }


def per_sample(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"])
    return ((h @ p["out"])[:, 0] - y) ** 2


def loss_sum_fn(p, mb, rng):
    m = mb["mask"].astype(jnp.float32)
    return jnp.sum(per_sample(p, mb["x"], mb["y"]) * m), jnp.sum(m)


def make_batch(n, seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {
        "x": jax.random.normal(kx, (n, 8)),
        "y": jax.random.normal(ky, (n,)),
        "mask": jnp.ones((n,), bool),
    }


def reference(params, batch):
    """Full-batch mean loss and gradient over the real rows, on one device, no microbatching."""
    keep = np.asarray(batch["mask"])
    x, y = (jax.device_put(np.asarray(batch[k])[keep], jax.devices()[0]) for k in ("x", "y"))
    return _mean_loss_and_grad(jax.device_put(params, jax.devices()[0]), x, y)


@jax.jit
def _mean_loss_and_grad(params, x, y):
    return jax.value_and_grad(lambda p: jnp.mean(per_sample(p, x, y)))(params)


def assert_tree_close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(MeshConfig(data=8))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_sharded_accumulation_matches_full_batch(mesh, k):
    params = init(jax.random.key(1))
    batch = make_batch(64)
    rows = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())
    placed = jax.device_put(batch, rows)
    fn = jax.jit(lambda p, b: accumulate_gradients(loss_sum_fn, p, b, k, microbatch_sharding=rows, accum_sharding=rep))
    loss, grads, metrics = fn(jax.device_put(params, rep), placed)
    ref_loss, ref_grads = reference(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-5)
    assert_tree_close(grads, ref_grads)
    assert int(metrics["num_real"]) == 64


@pytest.mark.parametrize(("n", "k"), [(56, 4), (64, 3)])
def test_padded_last_microbatch_matches_full_batch(mesh, n, k):
    params = init(jax.random.key(2))
    batch = make_batch(n, seed=3)
    rows = NamedSharding(mesh, P("data"))
    size, padded = microbatch_layout(n, k, 8)
    assert padded > n  # the split really pads
    fn = jax.jit(lambda p, b: accumulate_gradients(loss_sum_fn, p, b, k, microbatch_sharding=rows))
    loss, grads, metrics = fn(params, jax.device_put(batch, rows))
    ref_loss, ref_grads = reference(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-5)
    assert_tree_close(grads, ref_grads)
    assert int(metrics["num_real"]) == n


def test_missing_mask_is_added_and_existing_mask_respected():
    params = init(jax.random.key(4))
    batch = make_batch(10, seed=5)
    batch["mask"] = batch["mask"].at[7:].set(False)  # the data pipeline already masked 3 rows
    loss, grads, _ = jax.jit(accumulate_gradients, static_argnums=(0, 3))(loss_sum_fn, params, batch, 4)  # 4 x 3
    ref_loss, ref_grads = reference(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-5)
    assert_tree_close(grads, ref_grads)
    no_mask = {"x": batch["x"], "y": batch["y"]}
    loss2, _, metrics = jax.jit(accumulate_gradients, static_argnums=(0, 3))(loss_sum_fn, params, no_mask, 3)
    assert int(metrics["num_real"]) == 10
    np.testing.assert_allclose(float(loss2), float(reference(params, make_batch(10, seed=5))[0]), rtol=1e-5)


def test_accumulator_sharding_and_dtypes(mesh):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init(jax.random.key(6)))
    batch = jax.device_put(make_batch(64, seed=7), NamedSharding(mesh, P("data")))
    accum = {k: NamedSharding(mesh, P("data") if k == "w1" else P()) for k in params}
    fn = jax.jit(lambda p, b: accumulate_gradients(loss_sum_fn, p, b, 4, accum_sharding=accum))
    _, grads, _ = fn(params, batch)
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    assert grads["w1"].sharding.spec == P("data")
    f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    _, ref = reference(f32, make_batch(64, seed=7))
    assert_tree_close(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref, tol=2e-2)


def test_rng_per_microbatch_and_aux_summed():
    def noisy(p, mb, rng):
        s, n = loss_sum_fn(p, mb, rng)
        return s, (n, {"draw": jax.random.uniform(rng), "rows": jnp.sum(mb["mask"])})

    key = jax.random.key(8)
    acc = jax.jit(accumulate_gradients, static_argnums=(0, 3), static_argnames="has_aux")
    _, _, metrics = acc(noisy, init(key), make_batch(12), 3, key, has_aux=True)
    expected = sum(float(jax.random.uniform(jax.random.fold_in(key, i))) for i in range(3))
    np.testing.assert_allclose(float(metrics["aux"]["draw"]), expected, rtol=1e-6)
    assert int(metrics["aux"]["rows"]) == 12


def test_train_step_equals_full_batch_sgd(mesh):
    params = init(jax.random.key(9))
    batch = make_batch(64, seed=10)
    rows = NamedSharding(mesh, P("data"))
    ref_loss, ref_grads = reference(params, batch)
    state = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.5), rng=jax.random.key(0))
    step = jax.jit(make_train_step(loss_sum_fn, 8, microbatch_sharding=rows), donate_argnums=0)
    expected = jax.tree.map(lambda p, g: np.asarray(p) - 0.5 * np.asarray(g), params, ref_grads)
    new, metrics = step(state, jax.device_put(batch, rows))
    assert int(new.step) == 1
    assert_tree_close(new.params, expected)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(ref_grads)), rtol=1e-5)


def test_bad_batches_raise_typed_errors():
    params = init(jax.random.key(0))
    with pytest.raises(BatchError, match="leading"):
        accumulate_gradients(loss_sum_fn, params, {"x": jnp.ones((4, 8)), "y": jnp.ones((5,))}, 2)
    with pytest.raises(BatchError, match="dict batch"):
        accumulate_gradients(lambda p, b, r: (jnp.sum(b), 1), params, jnp.ones((5, 8)), 2)
    with pytest.raises(BatchError, match="positive int"):
        accumulate_gradients(loss_sum_fn, params, make_batch(4), 0)
    with pytest.raises(ShardingError, match="NamedSharding"):
        accumulate_gradients(loss_sum_fn, params, make_batch(4), 2, microbatch_sharding="data")
