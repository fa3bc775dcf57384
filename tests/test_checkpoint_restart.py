"""run_with_restarts: bounded retries with exponential backoff, restart count in the environment."""

import sys
import time

import pytest

from openhosti_jax.checkpoint import RESTART_ENV, run_with_restarts
from openhosti_jax.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # the tests start the supervised command as a process

FLAKY = """
import os, sys
log = sys.argv[1]
with open(log, "a") as f:
    f.write(os.environ["{env}"] + "\\n")
runs = len(open(log).read().split())
if runs <= int(sys.argv[2]):
    sys.exit(int(sys.argv[3])) if sys.argv[3] != "kill" else os.kill(os.getpid(), 9)
""".replace("{env}", RESTART_ENV)


def _cmd(log, failures, how="1"):
    return [sys.executable, "-c", FLAKY, str(log), str(failures), how]


@pytest.mark.timeout(60)
def test_restarts_until_success_and_counts_attempts(tmp_path):
    log = tmp_path / "runs"
    assert run_with_restarts(_cmd(log, 2), max_restarts=3, backoff_s=0.0) == 0
    assert log.read_text().split() == ["0", "1", "2"]


@pytest.mark.timeout(60)
def test_gives_up_after_max_restarts_with_the_last_exit_code(tmp_path):
    log = tmp_path / "runs"
    assert run_with_restarts(_cmd(log, 10, "3"), max_restarts=1, backoff_s=0.0) == 3
    assert log.read_text().split() == ["0", "1"]


@pytest.mark.timeout(60)
def test_a_sigkilled_command_is_restarted(tmp_path):
    log = tmp_path / "runs"
    assert run_with_restarts(_cmd(log, 1, "kill"), max_restarts=1, backoff_s=0.0) == 0
    assert run_with_restarts(_cmd(tmp_path / "r2", 5, "kill"), max_restarts=0, backoff_s=0.0) == -9


@pytest.mark.timeout(60)
def test_backoff_grows_geometrically(tmp_path):
    t0 = time.monotonic()
    rc = run_with_restarts(_cmd(tmp_path / "runs", 2), max_restarts=2, backoff_s=0.2, backoff_factor=2.0)
    assert rc == 0 and time.monotonic() - t0 >= 0.2 + 0.4


@pytest.mark.parametrize(
    "kwargs",
    [{"cmd": []}, {"cmd": ["x", 1]}, {"cmd": ["x"], "max_restarts": -1}, {"cmd": ["x"], "backoff_factor": 0.5}],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ConfigError):
        run_with_restarts(**kwargs)


SLOW_FAIL = """
import os, sys, time
with open(sys.argv[1], "a") as f:
    f.write(os.environ["{env}"] + "\\n")
if len(open(sys.argv[1]).read().split()) <= int(sys.argv[2]):
    time.sleep(float(sys.argv[3]))
    sys.exit(5)
""".replace("{env}", RESTART_ENV)


@pytest.mark.timeout(60)
def test_failures_after_a_long_healthy_run_do_not_use_up_the_restarts(tmp_path):
    def run(log, **kw):
        return run_with_restarts([sys.executable, "-c", SLOW_FAIL, str(log), "3", "0.5"], backoff_s=0.0, **kw)

    assert run(tmp_path / "a", max_restarts=1) == 5  # 3 failures, 1 restart allowed
    assert (tmp_path / "a").read_text().split() == ["0", "1"]
    assert run(tmp_path / "b", max_restarts=1, reset_after_s=0.3) == 0  # each failure came after 0.5 s of running
    assert (tmp_path / "b").read_text().split() == ["0", "1", "2", "3"]
    assert run(tmp_path / "c", max_restarts=1, reset_after_s=30) == 5  # too short to count as healthy


def test_cli_run_passes_the_backoff_options_and_rejects_bad_ones(tmp_path):
    from openhosti_jax.cli import main

    cmd = ["--", sys.executable, "-c", SLOW_FAIL, str(tmp_path / "log"), "2", "0.3"]
    assert main(["run", "--max-restarts", "1", "--backoff-s", "0", "--reset-after-s", "0.1", *cmd]) == 0
    assert main(["run", "--backoff-factor", "0.5", *cmd]) == 2  # a usage error, before anything runs
    assert main(["run", "--reset-after-s", "0", *cmd]) == 2
