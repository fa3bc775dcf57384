"""Every benchmark's quick mode runs to its JSON with every key of `benchmarks/README.md` printed and every goal
the table marks asserted met: a goal that held when its issue closed cannot stop holding unseen."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import goals  # noqa: E402

NOT_BENCHMARKS = ("goals.py", "gpu_suite.py")  # the table's reader; the runner of gpu_*.py and bridges.py
SCRIPTS = sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py"))
SCRIPTS = [f for f in SCRIPTS if f not in NOT_BENCHMARKS]
TIMEOUT_S = 600
LIMITS_S = {"scale.py": 1200}
"""Scripts allowed longer than TIMEOUT_S: scale.py runs ~45 planner searches over clusters of up to 6,144 devices
(pure CPU, no collectives to hang), 8-10 minutes on the 2-core machine when nothing else runs."""


def run_quick(script: str) -> dict:
    env = dict(os.environ)
    limit = LIMITS_S.get(script, TIMEOUT_S)
    # 8 simulated devices on 2 shared cores: a busy machine can hold a CPU collective's rendezvous past XLA's 40 s
    # abort; the test's own timeout bounds a real hang instead
    env["XLA_FLAGS"] = f"--xla_cpu_collective_call_terminate_timeout_seconds={limit}"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick"],
        capture_output=True,
        text=True,
        timeout=limit,
        env=env,
        cwd=ROOT,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"{script} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1])


def test_every_script_has_goals_and_every_goal_a_script():
    rows = goals.table()
    scripts = {r.script for r in rows}
    assert scripts <= set(SCRIPTS), scripts - set(SCRIPTS)
    assert {s for s in SCRIPTS if not s.startswith("gpu_")} <= scripts
    for r in rows:  # every goal parses
        value = [1.0] if r.goal.startswith("each ") else r.goal == "true" if r.goal in ("true", "false") else 1.0
        goals.meets(value, r.goal, {"compile_bound": 2.0})


def test_a_broken_goal_fails_the_check():
    rows = [goals.Goal("x.py", "ratio", "<= 1.0", True), goals.Goal("x.py", "absent", "true", True)]
    checked = goals.check({"ratio": 1.2}, "x.py", rows)
    assert checked["goals_met"] == {"ratio": False} and checked["missing_keys"] == ["absent"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=pytest.mark.timeout(LIMITS_S.get(s, TIMEOUT_S) + 60)) for s in SCRIPTS]
)
def test_quick_mode_meets_its_asserted_goals(script):
    out = run_quick(script)
    assert out.get("quick") is True, f"{script} did not run its quick mode"
    assert not out.get("missing_keys"), f"{script} printed no {out.get('missing_keys')}"
    failed = {
        k: (out[k], g) for k, g in out["goals"].items() if not g.endswith("(reported)") and out["goals_met"][k] is False
    }
    assert not failed, f"{script}: goals not met (value, goal): {failed}"
