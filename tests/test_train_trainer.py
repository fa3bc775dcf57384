"""Trainer: JSONL metrics equal the returned history; Ctrl-C ends cleanly with the last completed state."""

import json

import jax
import numpy as np
import pytest

from openhosti_jax import MeshConfig, Trainer, build_mesh
from openhosti_jax.demo.gpt_job import GPTJob, build_job
from openhosti_jax.train import read_metrics


@pytest.mark.slow  # 8 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_metrics_file_matches_history(tmp_path):
    state, _, step, data = build_job(
        GPTJob(steps=4, global_batch=8, num_sequences=64, progress=False), build_mesh(MeshConfig(data=-1))
    )
    path = tmp_path / "metrics.jsonl"
    result = Trainer(step, metrics_path=path, progress=False).fit(state, data, num_steps=4)
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in records], [h["loss"] for h in result.history])
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert int(result.state.step) == 4
    json.dumps(result.history)


@pytest.mark.slow  # 7 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_keyboard_interrupt_stops_cleanly(tmp_path):
    state, _, step, data = build_job(
        GPTJob(steps=10, global_batch=8, num_sequences=64, progress=False), build_mesh(MeshConfig(data=-1))
    )
    calls = {"n": 0}

    def interrupting_step(s, b):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return step(s, b)

    result = Trainer(interrupting_step, metrics_path=tmp_path / "m.jsonl", progress=False).fit(state, data, 10)
    assert result.interrupted
    assert int(result.state.step) == 2 and len(result.history) == 2
    assert len(read_metrics(tmp_path / "m.jsonl")) == 2


@pytest.mark.slow  # 26 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_trainer_resumes_from_its_checkpoint_bit_identically(tmp_path):
    from openhosti_jax.train import TrainerCheckpoint

    job = GPTJob(steps=6, global_batch=8, num_sequences=64, progress=False)
    mesh = build_mesh(MeshConfig(data=2, fsdp=4))

    def fit(steps, ckpt_dir):
        state, _, step, data = build_job(job, mesh)
        ckpt = TrainerCheckpoint(ckpt_dir, every_steps=3) if ckpt_dir else None
        return Trainer(step, progress=False, checkpoint=ckpt).fit(state, data, num_steps=steps), ckpt

    straight, _ = fit(6, None)
    first, _ = fit(3, tmp_path / "ckpt")
    resumed, ckpt = fit(6, tmp_path / "ckpt")
    assert ckpt.resumed_from == 3 and int(resumed.state.step) == 6
    losses = [h["loss"] for h in first.history + resumed.history]
    assert losses == [h["loss"] for h in straight.history]
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
