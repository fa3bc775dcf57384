"""RESOURCE_EXHAUSTED on a step halves the microbatch and re-runs the same batch; state is untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import MemoryBudgetError, StateError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.microbatch import OOMRetryStep, halve_microbatch, is_resource_exhausted, make_train_step
from openhosti_jax.state import TrainState

PER_DEVICE = 16
OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB."


def _loss(p, mb, rng):
    h = jnp.tanh(mb["x"] @ p["w1"])
    m = mb["mask"].astype(jnp.float32)
    return jnp.sum(((h @ p["w2"])[:, 0] - mb["y"]) ** 2 * m), jnp.sum(m)


@pytest.fixture(scope="module")
def setup():
    mesh = build_mesh(MeshConfig(data=8))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    n = 8 * PER_DEVICE
    batch = jax.device_put(
        {"x": jax.random.normal(k1, (n, 8)), "y": jax.random.normal(k2, (n,)), "mask": jnp.ones((n,), bool)}, rows
    )
    params = {"w1": jax.random.normal(k3, (8, 16)) / 3, "w2": jnp.ones((16, 1)) / 4}
    steps = {}
    tx = optax.adam(1e-2)  # one transformation: states built from it share a treedef (and the jit cache)

    def build(size):
        if size not in steps:
            step = make_train_step(_loss, PER_DEVICE // size, microbatch_sharding=rows)
            steps[size] = jax.jit(step, donate_argnums=0)
        return steps[size]

    def fresh_state():
        state = TrainState.create(apply_fn=None, params=params, tx=tx, rng=jax.random.key(1))
        return jax.tree.map(jnp.copy, jax.device_put(state, rep))

    return build, fresh_state, batch


def failing_first(build, fail_times=1, after_run=False):
    """build, but the first ``fail_times`` step calls raise RESOURCE_EXHAUSTED (optionally after really running)."""
    left = [fail_times]
    built = []

    def make(size):
        built.append(size)
        real = build(size)

        def step(state, batch):
            if left[0] > 0:
                left[0] -= 1
                if after_run:
                    real(state, batch)  # consumes the donated state, as an OOM mid-execution would
                raise jax.errors.JaxRuntimeError(OOM)
            return real(state, batch)

        return step

    return make, built


def to_np(tree):
    """The state's leaves as numpy arrays (PRNG keys as their key data)."""
    keyish = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    return [np.asarray(jax.random.key_data(x) if keyish(x) else x) for x in jax.tree.leaves(tree)]


@pytest.mark.timeout(300)
def test_injected_oom_retries_same_batch_with_same_result(setup):
    build, fresh_state, batch = setup
    ref16 = fresh_state()
    for _ in range(2):
        ref16, ref_metrics = build(16)(ref16, batch)
    ref8 = fresh_state()
    for _ in range(2):
        ref8, _ = build(8)(ref8, batch)

    make, built = failing_first(build)
    resized = []
    step = OOMRetryStep(make, PER_DEVICE, 16, on_resize=lambda a, b: resized.append((a, b)))
    state = fresh_state()
    for _ in range(2):
        state, metrics = step(state, batch)
    assert step.size == 8 and step.resizes == resized == [(16, 8)] and built == [16, 8]
    assert int(state.step) == 2  # the failed attempt did not count
    got, want8, want16 = to_np(state), to_np(ref8), to_np(ref16)
    for g, w8, w16 in zip(got, want8, want16, strict=True):
        np.testing.assert_array_equal(g, w8)  # same program as an uninterrupted size-8 run
        np.testing.assert_allclose(g, w16, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)


def test_repeated_ooms_shrink_until_it_fits_and_fail_typed_at_one(setup):
    build, fresh_state, batch = setup
    make, built = failing_first(build, fail_times=2)
    step = OOMRetryStep(make, PER_DEVICE, 16)
    state, _ = step(fresh_state(), batch)
    assert built == [16, 8, 4] and step.size == 4 and int(state.step) == 1
    make, _ = failing_first(build, fail_times=10)
    with pytest.raises(MemoryBudgetError, match="microbatch 1"):
        OOMRetryStep(make, PER_DEVICE, 2)(fresh_state(), batch)


def test_consumed_donation_is_reported_not_retried(setup):
    build, fresh_state, batch = setup
    make, built = failing_first(build, after_run=True)
    with pytest.raises(StateError, match="consumed donated inputs"):
        OOMRetryStep(make, PER_DEVICE, 16)(fresh_state(), batch)
    assert built == [16]


def test_compile_time_oom_and_other_errors(setup):
    build, fresh_state, batch = setup
    calls = []

    def make(size):
        calls.append(size)
        if size == 16:
            raise jax.errors.JaxRuntimeError(OOM)  # e.g. a TPU compile that does not fit
        return build(size)

    state, _ = OOMRetryStep(make, PER_DEVICE, 16)(fresh_state(), batch)
    assert calls == [16, 8] and int(state.step) == 1

    def broken(size):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        OOMRetryStep(broken, PER_DEVICE, 16)(fresh_state(), batch)
    with pytest.raises(MemoryBudgetError, match="divide"):
        OOMRetryStep(build, PER_DEVICE, 5)


def test_helpers():
    assert is_resource_exhausted(jax.errors.JaxRuntimeError(OOM))
    assert not is_resource_exhausted(RuntimeError(OOM))
    assert [halve_microbatch(s, 12) for s in (12, 6, 4, 3, 1)] == [6, 3, 2, 1, None]
    assert halve_microbatch(16, 48) == 8
