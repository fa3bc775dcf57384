"""balanced_step: the GPT loss and parameters equal the plain step's while a throttled device gets less work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openhosti_jax import MeshConfig, balanced_step, build_mesh
from openhosti_jax.balance import Throttle
from openhosti_jax.demo.gpt_job import GPTJob, build_job, gpt_loss_sum_fn
from openhosti_jax.errors import BatchError, StateError

JOB = GPTJob(steps=4, global_batch=32, num_sequences=256, plan="dp", progress=False)


@pytest.mark.slow  # 18 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_balanced_gpt_step_equals_plain_step_and_moves_work_off_a_slow_device():
    mesh = build_mesh(MeshConfig(data=4), devices=jax.devices()[:4])
    state, plan, plain, data = build_job(JOB, mesh)
    loss_sum_fn = gpt_loss_sum_fn(state.apply_fn, state.model_state)
    # device 3 stalls 3 x 10 ms per microbatch: slower without taking the 2 shared cores from its peers, so no
    # other device's timing is disturbed by its extra work (a compute throttle made the counts flaky under load)
    slow = Throttle.for_devices(4, {3: 4}, microbatch_seconds=0.01)
    balanced = balanced_step(loss_sum_fn, mesh=mesh, plan=plan, microbatches=16, every=1, throttle=slow)
    ref_state, _, _, _ = build_job(JOB, mesh)
    losses, ref_losses = [], []
    for _ in range(4):
        batch = next(data)
        state, m = balanced(state, batch)
        ref_state, r = plain(ref_state, batch)
        losses.append(float(m["loss"]))
        ref_losses.append(float(r["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    counts = balanced.balancer.counts
    assert sum(counts) == 16 and counts[3] == min(counts) and counts[3] < 4
    assert balanced.progress_note() is not None


@pytest.mark.slow  # 9 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_balance_needs_a_plan_and_divisible_batches():
    mesh = build_mesh(MeshConfig(data=4), devices=jax.devices()[:4])
    state, plan, _, data = build_job(JOB, mesh)
    loss_sum_fn = gpt_loss_sum_fn(state.apply_fn, state.model_state)
    with pytest.raises(StateError, match="ShardingPlan"):
        balanced_step(loss_sum_fn, mesh=mesh, plan="dp")
    step = balanced_step(loss_sum_fn, mesh=mesh, plan=plan, microbatches=5)
    with pytest.raises(BatchError, match="not divisible by microbatches=5"):
        step(state, next(data))


@pytest.mark.slow  # 10 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_a_non_finite_balanced_step_leaves_the_state_as_it_was():
    mesh = build_mesh(MeshConfig(data=4), devices=jax.devices()[:4])
    state, plan, _, data = build_job(JOB, mesh)
    loss_sum_fn = gpt_loss_sum_fn(state.apply_fn, state.model_state)

    def nan_loss(p, mb, rng):
        total, n = loss_sum_fn(p, mb, rng)
        return total * jnp.nan, n

    before = jax.device_get(state)
    after, m = balanced_step(nan_loss, mesh=mesh, plan=plan, microbatches=8)(state, next(data))
    assert int(m["skipped_nonfinite"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(after)), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
