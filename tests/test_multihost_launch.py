"""`launch_local` on plain Python children: environment, prefixed logs, exit codes, bounded teardown, timeouts."""

import io
import sys
import time

import pytest

from openhosti_jax.errors import DistributedError
from openhosti_jax.mesh.launch import TIMEOUT_EXIT_CODE, child_env, launch_local

PY = sys.executable


def run(code: str, n: int, **kw) -> tuple[int, str, float]:
    out = io.StringIO()
    t0 = time.monotonic()
    rc = launch_local([PY, "-c", code], n, output=out, **kw)
    return rc, out.getvalue(), time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_every_process_gets_its_id_the_coordinator_and_devices_and_prefixed_logs():
    code = (
        "import os; e = os.environ; "
        "print(e['OPENHOSTI_PROCESS_ID'], e['OPENHOSTI_NUM_PROCESSES'], e['OPENHOSTI_COORDINATOR'], "
        "e['JAX_PLATFORMS'], e['XLA_FLAGS'], sep='|')"
    )
    rc, out, _ = run(
        code, 3, local_devices=4, env={"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}
    )
    assert rc == 0
    rows = sorted(line.split("|") for line in out.splitlines())
    assert [r[0] for r in rows] == ["[p0] 0", "[p1] 1", "[p2] 2"]
    assert {r[1] for r in rows} == {"3"}
    (coord,) = {r[2] for r in rows}
    host, port = coord.split(":")
    assert host == "127.0.0.1" and 1 <= int(port) <= 65535
    assert {r[3] for r in rows} == {"cpu"}
    assert {r[4] for r in rows} == {"--xla_foo=1 --xla_force_host_platform_device_count=4"}


def test_child_env_gives_one_launchers_variables_and_drops_inherited_ones():
    inherited = {"SLURM_JOB_ID": "9", "RANK": "3", "OPENHOSTI_PROCESS_ID": "7", "PATH": "/bin"}
    env = child_env(1, 2, "127.0.0.1:61500", 2, inherited, launcher="openmpi")
    assert not {"SLURM_JOB_ID", "RANK", "OPENHOSTI_PROCESS_ID"} & set(env) and env["PATH"] == "/bin"
    assert (env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]) == ("1", "2")
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_child_env_leaves_the_platform_alone_without_local_devices():
    env = child_env(1, 2, "127.0.0.1:5", None, {"XLA_FLAGS": "--a", "PATH": "/bin"})
    assert env["XLA_FLAGS"] == "--a" and "JAX_PLATFORMS" not in env
    assert (env["OPENHOSTI_PROCESS_ID"], env["OPENHOSTI_NUM_PROCESSES"]) == ("1", "2")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_first_failure_is_returned_and_the_others_are_stopped_quickly():
    code = (
        "import os, sys, time\n"
        "if os.environ['OPENHOSTI_PROCESS_ID'] == '1':\n"
        "    time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(300)\n"
    )
    rc, out, dt = run(code, 3, kill_grace_s=2)
    assert rc == 3
    assert dt < 15, dt  # 0.5 s + SIGTERM; far below the 300 s the others would sleep
    assert "exit code 3" in out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period():
    code = (
        "import os, signal, sys, time\n"
        "if os.environ['OPENHOSTI_PROCESS_ID'] == '1':\n"
        "    time.sleep(0.5); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); time.sleep(300)\n"
    )
    rc, out, dt = run(code, 2, kill_grace_s=1.5)
    assert rc == 7 and "[p0] ignoring" in out
    assert 1.5 < dt < 15, dt


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_signal_deaths_follow_the_shell_convention_and_success_is_zero():
    rc, _, _ = run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 2)
    assert rc == 128 + 9
    rc, out, _ = run("print('partial line', end='')", 2, prefix_output=False)
    assert rc == 0 and sorted(out.splitlines()) == ["partial line", "partial line"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_timeout_stops_everything():
    rc, out, dt = run("import time; time.sleep(300)", 2, timeout_s=1.0, kill_grace_s=1)
    assert rc == TIMEOUT_EXIT_CODE and "timeout" in out
    assert dt < 15


@pytest.mark.parametrize(
    "args, kw, needle",
    [
        ("python x.py", {}, "list of strings"),
        ([], {}, "list of strings"),
        ([PY], {"num_processes": 0}, "num_processes"),
        ([PY], {"local_devices": 0}, "local_devices"),
        ([PY], {"port": 70000}, "port"),
        ([PY], {"kill_grace_s": -1}, "kill_grace_s"),
        ([PY], {"timeout_s": 0}, "timeout_s"),
        ([PY], {"launcher": "pbs"}, "launcher"),
    ],
)
def test_bad_arguments_raise_a_typed_error_naming_the_argument(args, kw, needle):
    n = kw.pop("num_processes", 2)
    with pytest.raises(DistributedError, match=needle):
        launch_local(args, n, **kw)


_LISTENING = """
import os, sys
from openhosti_jax.mesh import initialize_distributed
from openhosti_jax.mesh.barrier import gathered
assert initialize_distributed()
port = int(os.environ["OPENHOSTI_COORDINATOR"].rsplit(":", 1)[1])
if os.environ["OPENHOSTI_PROCESS_ID"] == "0":
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:  # LISTEN
                found.append(address)
    print("LISTENING", ",".join(sorted(found)))
gathered("done", 1)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_local_launch_coordinator_listens_on_loopback_only():
    """Process 0's coordinator of a local launch binds 127.0.0.1 (jax's default is every interface, ``[::]``)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc, out, _ = run(_LISTENING, 2, local_devices=1, env=env, timeout_s=100, kill_grace_s=2)
    assert rc == 0, out[-3000:]
    (line,) = [x for x in out.splitlines() if "LISTENING" in x]
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, plain or IPv4-mapped, as /proc shows it
    assert set(line.split("LISTENING ")[1].split(",")) <= loopback, out[-3000:]
