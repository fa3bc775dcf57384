"""The balanced step's loss and gradient equal a single-device full-batch reference for any assignment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openhosti_jax.balance import (
    Balancer,
    Throttle,
    make_balanced_grad_fn,
    pack_microbatches,
    place_microbatches,
)
from openhosti_jax.errors import BalanceError
from openhosti_jax.mesh import MeshConfig, build_mesh

M, MB, DIN, H = 8, 4, 6, 16


def loss_sum_fn(params, mb, rng):
    """Masked MSE of a 2-layer MLP with dropout: (sum over real rows, number of real rows)."""
    h = jnp.tanh(mb["x"] @ params["w1"] + params["b1"])
    keep = jax.random.bernoulli(rng, 0.8, h.shape)
    h = jnp.where(keep, h / 0.8, 0.0)
    err = jnp.sum((h @ params["w2"] - mb["y"]) ** 2, axis=-1)
    return jnp.sum(err * mb["mask"]), jnp.sum(mb["mask"])


def make_data(seed=0):
    r = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(r.normal(size=(DIN, H)), jnp.float32) * 0.5,
        "b1": jnp.zeros(H, jnp.float32),
        "w2": jnp.asarray(r.normal(size=(H, 2)), jnp.float32) * 0.5,
    }
    mask = np.ones((M, MB), np.float32)
    mask[2, 1:] = 0.0  # padded rows: the mean must be over the 28 real samples only
    mask[7, 3] = 0.0
    mbs = {
        "x": r.normal(size=(M, MB, DIN)).astype(np.float32),
        "y": r.normal(size=(M, MB, 2)).astype(np.float32),
        "mask": mask,
    }
    return params, mbs


def reference(params, mbs, rng):
    """Sequential on one device: microbatch k uses fold_in(rng, k); mean over all real samples."""
    singles = [{key: jnp.asarray(v[k]) for key, v in mbs.items()} for k in range(M)]
    total = lambda p: sum(loss_sum_fn(p, singles[k], jax.random.fold_in(rng, k))[0] for k in range(M))
    n = float(mbs["mask"].sum())
    loss, g = jax.value_and_grad(total)(params)
    return loss / n, jax.tree_util.tree_map(lambda a: a / n, g), n


@pytest.fixture(scope="module")
def mesh4():
    return jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])


def assert_close(got, want, tol=1e-6):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


@pytest.mark.parametrize("counts", [(2, 2, 2, 2), (3, 1, 2, 2), (5, 1, 1, 1), (0, 4, 4, 0)])
def test_grad_equals_reference_for_any_assignment(mesh4, counts):
    params, mbs = make_data()
    rng = jax.random.key(3)
    ref_loss, ref_g, ref_n = reference(params, mbs, rng)
    step = make_balanced_grad_fn(loss_sum_fn, mesh4, capacity=5)
    loss, g, n = step(params, place_microbatches(mbs, counts, 5, mesh4), counts, rng)
    assert float(n) == ref_n == 28.0
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_close(g, ref_g)


def test_probe_and_throttle_do_not_change_the_result(mesh4):
    params, mbs = make_data(1)
    rng = jax.random.key(0)
    counts = (3, 1, 2, 2)
    _, ref_g, _ = reference(params, mbs, rng)
    step = make_balanced_grad_fn(loss_sum_fn, mesh4, capacity=4, throttle=Throttle.for_devices(4, {1: 3}))
    buf = place_microbatches(mbs, counts, 4, mesh4)
    (loss_p, g_p, _), seconds = step.probe(params, buf, counts, rng)
    loss, g, _ = step(params, buf, counts, rng)
    assert_close(g, ref_g)
    assert_close(g_p, g, tol=0)
    assert float(loss_p) == float(loss)
    assert seconds.shape == (4,) and np.isfinite(seconds).all() and (seconds > 0).all()


def test_stall_throttle_slows_only_its_device_and_keeps_the_result(mesh4):
    """A stalled device's local phase takes its stall on top of the work; the others' do not; the gradient is
    the reference's."""
    params, mbs = make_data(3)
    rng = jax.random.key(0)
    counts = (2, 2, 2, 2)
    _, ref_g, _ = reference(params, mbs, rng)
    stall = 0.05  # 2 microbatches x (3 - 1) x 50 ms = 0.2 s on device 2
    step = make_balanced_grad_fn(
        loss_sum_fn, mesh4, capacity=4, throttle=Throttle.for_devices(4, {2: 3}, microbatch_seconds=stall)
    )
    buf = place_microbatches(mbs, counts, 4, mesh4)
    (_, g, _), seconds = step.probe(params, buf, counts, rng)
    assert_close(g, ref_g)
    assert seconds[2] >= 2 * 2 * stall, seconds
    assert max(seconds[[0, 1, 3]]) < 2 * stall, seconds  # nobody else waits for the stall
    with pytest.raises(BalanceError, match="microbatch_seconds"):
        Throttle((1, 2), microbatch_seconds=0.0)


def test_mesh_with_other_axes_reduces_over_data_only():
    mesh = build_mesh(MeshConfig(data=4, fsdp=2))
    params, mbs = make_data(2)
    rng = jax.random.key(1)
    _, ref_g, _ = reference(params, mbs, rng)
    step = make_balanced_grad_fn(loss_sum_fn, mesh, capacity=4)
    counts = (1, 3, 2, 2)
    (_, g, n), seconds = step.probe(params, place_microbatches(mbs, counts, 4, mesh), counts, rng)
    assert float(n) == 28.0
    assert_close(g, ref_g)
    assert np.isfinite(seconds).all()


def test_pack_matches_place(mesh4):
    _, mbs = make_data()
    counts = (3, 1, 0, 4)
    packed = pack_microbatches(mbs, counts, 4)
    placed = place_microbatches(mbs, counts, 4, mesh4)
    for a, b in zip(jax.tree_util.tree_leaves(packed), jax.tree_util.tree_leaves(placed), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    np.testing.assert_array_equal(packed["x"][4], mbs["x"][3])  # device 1 slot 0 = global microbatch 3
    assert not packed["x"][8:12].any()  # device 2 holds only padding


def test_bad_assignments_raise(mesh4):
    params, mbs = make_data()
    step = make_balanced_grad_fn(loss_sum_fn, mesh4, capacity=3)
    buf = place_microbatches(mbs, (2, 2, 2, 2), 3, mesh4)
    rng = jax.random.key(0)
    with pytest.raises(BalanceError, match="one per data-parallel device"):
        step(params, buf, (4, 4), rng)
    with pytest.raises(BalanceError, match="0..capacity=3"):
        step(params, buf, (5, 1, 1, 1), rng)
    with pytest.raises(BalanceError, match="summing to the step's 8"):
        place_microbatches(mbs, (1, 1, 1, 1), 3, mesh4)
    with pytest.raises(BalanceError, match="slots <= capacity 2"):
        make_balanced_grad_fn(loss_sum_fn, mesh4, capacity=2)(params, buf, (2, 2, 2, 2), rng)
    with pytest.raises(BalanceError, match="capacity"):
        make_balanced_grad_fn(loss_sum_fn, mesh4, capacity=0)
    with pytest.raises(BalanceError, match="4 factors"):
        make_balanced_grad_fn(loss_sum_fn, mesh4, capacity=3, throttle=Throttle((1, 2)))
    with pytest.raises(BalanceError, match="ints >= 1"):
        Throttle((1, 0, 1, 1))


def test_balancer_moves_work_off_a_throttled_device_and_keeps_the_gradient(mesh4):
    """Device 3 does 6x the work per microbatch: after a few probes it holds the fewest microbatches."""
    r = np.random.default_rng(0)
    params = {"w": jnp.asarray(r.normal(size=(256, 256)), jnp.float32) * 0.05}
    mbs = {"x": r.normal(size=(16, 64, 256)).astype(np.float32)}

    def heavy_loss(p, mb, rng):
        h = mb["x"]
        for _ in range(4):
            h = jnp.tanh(h @ p["w"])
        return jnp.sum(h**2), jnp.float32(mb["x"].shape[0])

    bal = Balancer(heavy_loss, mesh4, total=16, every=1, alpha=1.0, throttle=Throttle.for_devices(4, {3: 6}))
    rng = jax.random.key(0)
    for _ in range(4):
        loss, g, n = bal(params, mbs, rng)
    counts = bal.counts
    # one microbatch on device 3 costs 6 units, as its peers' 5 or 6 do: with no cap, 1 and 0 price the same step
    assert sum(counts) == 16 and counts[3] <= 1
    assert counts[3] < min(counts[:3]), counts
    assert bal.describe() is not None
    ref = jax.grad(lambda p: sum(heavy_loss(p, {"x": mbs["x"][k]}, None)[0] for k in range(16)) / (16 * 64))
    assert_close(g, ref(params), tol=1e-5)
