"""A resumed run keeps the plan its checkpoint was trained with (unless the devices changed or a new plan is asked
for), says that it resumed and what is left, and the README demo keeps library warnings off the terminal."""

import os
import subprocess
import sys
import types

import jax
import pytest

from openhosti_jax import MeshConfig, build_mesh
from openhosti_jax.demo.gpt_job import GPTJob, kept_plan, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(tmp_path, plan, steps, **kw):
    return GPTJob(
        steps=steps,
        global_batch=8,
        num_sequences=64,
        plan=plan,
        progress=False,
        print_plan=False,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every_steps=2,
        **kw,
    )


@pytest.mark.slow  # 27 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_the_resumed_run_keeps_the_saved_plan_and_a_replan_is_honoured(tmp_path):
    first = run_job(_job(tmp_path, "zero1", 2), build_mesh(MeshConfig(data=2, fsdp=4)))
    assert len(first.history) == 2
    # Asked for another strategy on another mesh, the resumed run still trains the saved plan.
    from openhosti_jax.demo.gpt_job import build_job
    from openhosti_jax.train import TrainerCheckpoint

    ckpt = TrainerCheckpoint(tmp_path / "ckpt")
    keep, note = kept_plan(ckpt, _job(tmp_path, "fsdp", 4))
    assert keep["zero_stage"] == 1 and keep["mesh_shape"]["data"] == 2 and keep["mesh_shape"]["fsdp"] == 4
    assert "keeping the plan" in note
    _, plan, _, _ = build_job(_job(tmp_path, "fsdp", 4), build_mesh(MeshConfig(data=8)), keep)
    assert plan.zero_stage == 1 and dict(plan.mesh_shape)["fsdp"] == 4
    _, again = kept_plan(ckpt, _job(tmp_path, "fsdp", 4, replan=True))
    assert "planning again" in again
    ckpt.close()
    resumed = run_job(_job(tmp_path, "fsdp", 4), build_mesh(MeshConfig(data=8)))
    assert [r["step"] for r in resumed.history] == [3, 4]
    assert resumed.events == [{"event": "resumed", "step": 2, "steps_left": 2}]


def test_a_changed_device_count_replans():
    saved = {"plan_decision": {"mesh_shape": {"data": 4}, "zero_stage": 0, "devices": jax.device_count() // 2}}
    fake = types.SimpleNamespace(saved_meta=lambda: saved, manager=types.SimpleNamespace(latest_good_step=lambda: 7))
    keep, note = kept_plan(fake, GPTJob())
    assert keep is None and "the planner chose again" in note and "step 7" in note


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_demo_prints_only_the_plan_progress_and_summary_and_says_when_it_resumed(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "examples", "train_gpt.py"),
        "--steps",
        "4",
        "--run-dir",
        str(tmp_path / "run"),
        "--checkpoint-every",
        "2",
        "--plan",
        "fsdp",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    noise = [line for line in first.stderr.replace("\r", "\n").splitlines() if line.strip() and "step" not in line]
    assert noise == [], noise
    assert first.stdout.startswith("ShardingPlan") and "trained 4 steps" in first.stdout
    assert (tmp_path / "run" / "log.txt").exists()
    again = subprocess.run(
        cmd[:3] + ["6"] + cmd[4:], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )
    assert "keeping the plan the checkpoint was trained with" in again.stdout
    assert "resumed from the checkpoint at step 4: 2 of 6 steps left" in again.stdout
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert "the run is already complete" in done.stdout and "nothing to train" in done.stdout
