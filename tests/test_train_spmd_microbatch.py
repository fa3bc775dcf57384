"""@spmd(microbatch=...): accumulation inside the decorated GPT step equals the unsplit step; "auto" fits a budget."""

import numpy as np
import pytest

from openhosti_jax import MeshConfig, build_mesh, spmd
from openhosti_jax.demo.gpt_job import GPTJob, build_job, gpt_train_step
from openhosti_jax.errors import BatchError
from openhosti_jax.microbatch import peak_bytes

JOB = GPTJob(steps=3, global_batch=32, num_sequences=256, progress=False)


def _losses(microbatch, steps=3, **kw):
    mesh = build_mesh(MeshConfig(data=2, fsdp=4))
    state, plan, _, data = build_job(JOB, mesh)
    step = spmd(gpt_train_step, mesh=mesh, plan=plan, microbatch=microbatch, **kw)
    out = []
    for _ in range(steps):
        state, m = step(state, next(data))
        out.append(float(m["loss"]))
    return out, step


@pytest.mark.slow  # 13 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_four_microbatches_equal_one():
    one, s1 = _losses(None)
    four, s4 = _losses(4)
    assert s1.num_microbatches == 1 and s4.num_microbatches == 4
    np.testing.assert_allclose(four, one, rtol=1e-5)


@pytest.mark.slow  # 41 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(180)
def test_auto_microbatch_fits_the_budget_and_twice_does_not():
    _, full = _losses(None, steps=1)
    mesh = full.mesh
    state, _, _, data = build_job(JOB, mesh)
    state, batch = full.place(state, next(data))
    peaks = {k: peak_bytes(full.lower(state, batch, k).compile()) for k in (1, 2, 4)}
    # a budget between the peaks of 2 and 1 accumulation steps (per-device microbatch 2 vs 4)
    budget = int((peaks[1] + peaks[2]) / 2 / 0.9)
    _, auto = _losses("auto", steps=1, memory_budget=budget)
    choice = auto.microbatch_choice
    assert choice.peak_bytes <= budget * 0.9
    assert choice.size == 2 and auto.num_microbatches == 2
    assert choice.compiles <= choice.per_device_batch.bit_length() + 2
    assert any("microbatch auto" in e for e in auto.report.events)
    assert "microbatches    2" in str(auto.plan)  # the plan prints the count the step runs


def test_microbatch_count_must_divide_the_per_device_batch():
    with pytest.raises(BatchError, match="do not divide the per-device batch 4"):
        _losses(3, steps=1)
