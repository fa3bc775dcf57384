"""@spmd: FSDP on 8 devices reproduces a 1-device run; FSDP argument bytes are a fraction of DP; bad batches."""

import jax
import numpy as np
import pytest

from openhosti_jax import MeshConfig, build_mesh
from openhosti_jax.errors import BatchError
from openhosti_jax.models.gpt import GPTConfig
from openhosti_jax.models.gpt_job import GPTJob, build_job

JOB = GPTJob(model=GPTConfig.tiny(), steps=20, global_batch=16, num_sequences=512, progress=False)


def _train(plan, mesh, steps):
    state, _, step, data = build_job(GPTJob(**{**JOB.__dict__, "plan": plan}), mesh)
    losses = []
    for _ in range(steps):
        state, m = step(state, next(data))
        losses.append(float(m["loss"]))
    return losses, jax.device_get(state.params)


def test_fsdp_8_devices_matches_one_device_for_20_steps():
    fsdp_losses, fsdp_params = _train("fsdp", build_mesh(MeshConfig(data=1, fsdp=8)), 20)
    one_losses, one_params = _train("dp", build_mesh(MeshConfig(data=1), devices=jax.devices()[:1]), 20)
    np.testing.assert_allclose(fsdp_losses, one_losses, rtol=1e-5)
    assert fsdp_losses[-1] < fsdp_losses[0] - 1.0  # it learned
    for a, b in zip(jax.tree.leaves(fsdp_params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _argument_bytes(plan, mesh_config):
    state, _, step, data = build_job(GPTJob(**{**JOB.__dict__, "plan": plan, "mesh": mesh_config}))
    state, batch = step.place(state, next(data))
    return step.lower(state, batch).compile().memory_analysis().argument_size_in_bytes


def test_fsdp_argument_bytes_are_at_most_a_fifth_of_data_parallel():
    fsdp = _argument_bytes("fsdp", MeshConfig(data=1, fsdp=8))
    dp = _argument_bytes("dp", MeshConfig(data=8))
    assert fsdp <= 0.2 * dp, (fsdp, dp)


def test_batch_not_divisible_by_data_axes_is_a_typed_error():
    state, _, step, data = build_job(JOB, build_mesh(MeshConfig(data=1, fsdp=8)))
    batch = {"tokens": next(data)["tokens"][:12]}
    with pytest.raises(BatchError, match="not divisible by the 8 data-parallel shards"):
        step(state, batch)
