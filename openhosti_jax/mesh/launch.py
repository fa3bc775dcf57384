"""`launch_local`: run one command as N cooperating `jax.distributed` processes on this machine (127.0.0.1).

Each child gets ``OPENHOSTI_COORDINATOR`` (a free loopback port), ``OPENHOSTI_NUM_PROCESSES`` and
``OPENHOSTI_PROCESS_ID``, which `initialize_distributed` reads, and with ``local_devices`` set, a CPU platform
with that many simulated devices. ``launcher="torchrun" | "slurm" | "openmpi" | "jobset"`` gives each child the
environment that launcher gives its tasks on a single node instead (`launcher_env`), to rehearse a cluster start.
Output is streamed line by line with a ``[pK]`` prefix. When one child exits non-zero the others get SIGTERM, then
SIGKILL after ``kill_grace_s``: a dead peer never leaves the rest hanging in a collective. Exit codes follow the
shell: a child killed by signal ``S`` counts as ``128 + S``.

Example:
    >>> import io, sys
    >>> from openhosti_jax.mesh.launch import launch_local
    >>> code = "import os; print('rank', os.environ['OPENHOSTI_PROCESS_ID'])"
    >>> log = io.StringIO()
    >>> launch_local([sys.executable, "-c", code], 2, output=log)
    0
    >>> sorted(log.getvalue().splitlines())
    ['[p0] rank 0', '[p1] rank 1']
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from openhosti_jax.errors import ConfigError, DistributedError
from openhosti_jax.mesh.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, LAUNCHER_ENV

TIMEOUT_EXIT_CODE = 124
"""What `launch_local` returns when ``timeout_s`` ran out before the children finished (as coreutils timeout)."""
LAUNCHERS = ("openhosti", "torchrun", "slurm", "openmpi", "jobset")
"""The environments `launch_local` can give its children."""
DERIVED_PORTS = (65535 - 2**12 + 1, 65535)
"""jax derives a SLURM or Open MPI coordinator port from the job id, always within this range."""

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_POLL_S = 0.05
_SLURM_NODE = "localhost"  # SLURM_STEP_NODELIST of a one-node step on this machine (jax takes its first host)
_JOBSET_NAME = "local"


def free_port(host: str = "127.0.0.1", low: int | None = None, high: int | None = None) -> int:
    """A TCP port that was free on ``host`` a moment ago: the OS picks it, or one in ``low..high`` (inclusive).

    >>> low, high = DERIVED_PORTS
    >>> low <= free_port(low=low, high=high) <= high
    True
    """
    if low is None or high is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    for port in random.Random().sample(range(low, high + 1), min(256, high - low + 1)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise DistributedError(f"expected a free TCP port in {low}..{high} on {host}, found none; free some or pass port=")


def launcher_env(launcher: str, process_id: int, num_processes: int, port: int) -> dict[str, str]:
    """The variables ``launcher`` gives task ``process_id`` of ``num_processes``, all on this node, such that the
    `jax.distributed` coordinator ends up on ``127.0.0.1:port`` (or ``localhost:port``).

    SLURM and Open MPI name no port: jax derives it from the job id, so the job id is chosen to give ``port``
    (in `DERIVED_PORTS`; another port goes in ``JAX_COORDINATOR_PORT``, jax's override). The JobSet's variables
    are those ``examples/k8s/jobset.yaml`` sets, with ``127.0.0.1`` for pod 0's DNS name.

    >>> launcher_env("torchrun", 1, 2, 29501)["MASTER_PORT"]  # jax's coordinator listens on MASTER_PORT + 1
    '29500'
    >>> launcher_env("slurm", 0, 2, 61500)["SLURM_JOB_ID"]  # jax: 61440 + job id % 4096 == 61500
    '409660'
    """
    n, i = str(num_processes), str(process_id)
    low, high = DERIVED_PORTS
    derived = low <= port <= high
    if launcher == "openhosti":
        return {ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: n, ENV_PROCESS_ID: i}
    if launcher == "torchrun":
        return {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port - 1),
            "RANK": i,
            "WORLD_SIZE": n,
            "LOCAL_RANK": i,
            "LOCAL_WORLD_SIZE": n,
            "GROUP_RANK": "0",
        }
    if launcher == "slurm":
        env = {
            "SLURM_JOB_ID": str(100 * 4096 + (port - low if derived else 0)),
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": _SLURM_NODE,
            "SLURM_STEP_NODELIST": _SLURM_NODE,
            "SLURM_NNODES": "1",
            "SLURM_STEP_NUM_NODES": "1",
            "SLURM_NODEID": "0",
            "SLURM_NTASKS": n,
            "SLURM_STEP_NUM_TASKS": n,
            "SLURM_PROCID": i,
            "SLURM_LOCALID": i,
        }
        return env if derived else {**env, "JAX_COORDINATOR_PORT": str(port)}
    if launcher == "openmpi":
        job = (100 * 4096 + (port - low if derived else 0)) * 4096  # an HNP job id is a multiple of 2**12
        env = {
            # mpirun's own address; no mpirun daemon listens on its port here (jax reads only the host)
            "OMPI_MCA_orte_hnp_uri": f"{job}.0;tcp://127.0.0.1:1",
            "OMPI_COMM_WORLD_SIZE": n,
            "OMPI_COMM_WORLD_RANK": i,
            "OMPI_COMM_WORLD_LOCAL_RANK": i,
            "OMPI_COMM_WORLD_LOCAL_SIZE": n,
            "OMPI_COMM_WORLD_NODE_RANK": i,
        }
        return env if derived else {**env, "JAX_COORDINATOR_PORT": str(port)}
    if launcher == "jobset":
        return {
            "JOBSET_NAME": _JOBSET_NAME,
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: n,
            "JOB_COMPLETION_INDEX": i,  # set by the Job controller for every pod of an Indexed Job
        }
    raise ConfigError(f"expected launcher in {LAUNCHERS}, found {launcher!r}")


def child_env(
    process_id: int,
    num_processes: int,
    coordinator: str,
    local_devices: int | None,
    base: Mapping[str, str],
    launcher: str = "openhosti",
) -> dict[str, str]:
    """The environment of child ``process_id``: ``base`` without any launcher's variables, plus ``launcher``'s
    for the coordinator ``host:port``, and the simulated devices."""
    env = {k: v for k, v in base.items() if k not in LAUNCHER_ENV}
    env.update(launcher_env(launcher, process_id, num_processes, int(coordinator.rsplit(":", 1)[1])))
    env["PYTHONUNBUFFERED"] = "1"
    if local_devices is not None:
        kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
        env["XLA_FLAGS"] = " ".join([*kept, f"{_DEVICE_FLAG}={local_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _check_args(
    cmd: Sequence[str],
    num_processes: int,
    local_devices: int | None,
    port: int | None,
    kill_grace_s: float,
    timeout_s: float | None,
    launcher: str,
) -> None:
    problems = []
    if launcher not in LAUNCHERS:
        problems.append(f"launcher must be one of {LAUNCHERS}, found {launcher!r}")
    if isinstance(cmd, str) or not cmd or not all(isinstance(c, str) for c in cmd):
        problems.append(f"cmd must be a non-empty list of strings (argv), found {cmd!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        problems.append(f"num_processes must be an int >= 1, found {num_processes!r}")
    if local_devices is not None and (not isinstance(local_devices, int) or local_devices < 1):
        problems.append(f"local_devices must be None or an int >= 1, found {local_devices!r}")
    if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535):
        problems.append(f"port must be None (pick a free one) or in 1..65535, found {port!r}")
    if kill_grace_s < 0:
        problems.append(f"kill_grace_s must be >= 0, found {kill_grace_s}")
    if timeout_s is not None and timeout_s <= 0:
        problems.append(f"timeout_s must be None (no limit) or > 0, found {timeout_s}")
    if problems:
        raise DistributedError("launch_local: " + "; ".join(problems))


def _pump(stream: TextIO, prefix: str, output: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            output.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            output.flush()
    stream.close()


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)  # each child leads its own process group: its own children go too
            except (ProcessLookupError, PermissionError):
                pass


def _stop_all(procs: list[subprocess.Popen], kill_grace_s: float) -> None:
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + kill_grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def launch_local(
    cmd: Sequence[str],
    num_processes: int,
    *,
    local_devices: int | None = None,
    port: int | None = None,
    kill_grace_s: float = 10,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    output: TextIO | None = None,
    prefix_output: bool = True,
    launcher: str = "openhosti",
) -> int:
    """Run ``cmd`` as ``num_processes`` processes of one `jax.distributed` job on 127.0.0.1; return its exit code.

    Args:
        cmd: the argv every process runs, e.g. ``[sys.executable, "train.py"]``; it should call
            `openhosti_jax.mesh.initialize_distributed()` before touching devices.
        num_processes: how many processes (process ids ``0..N-1``; process 0 hosts the coordinator).
        local_devices: simulated CPU devices per process (sets ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS``);
            ``None`` leaves the platform to the inherited environment.
        port: coordinator port; ``None`` picks a free one.
        kill_grace_s: after the first failure, seconds between SIGTERM and SIGKILL of the others.
        timeout_s: stop everything after this many seconds and return `TIMEOUT_EXIT_CODE` (``None``: no limit).
        env: extra environment variables for every child (on top of ``os.environ``).
        output: where the prefixed lines go (default ``sys.stdout``).
        prefix_output: prefix each line with ``[pK] ``.
        launcher: whose environment the children get (`LAUNCHERS`, `launcher_env`); any launcher variables
            inherited from this process are removed first. ``slurm`` and ``openmpi`` pick a free port in
            `DERIVED_PORTS`.

    Returns:
        0 when every process exited 0, else the exit code of the first process that failed (``128 + signal``
        for one killed by a signal), or `TIMEOUT_EXIT_CODE`.
    """
    _check_args(cmd, num_processes, local_devices, port, kill_grace_s, timeout_s, launcher)
    output = output or sys.stdout
    if port is None:
        derived = launcher in ("slurm", "openmpi")  # jax derives their port: pick one it can derive
        port = free_port(low=DERIVED_PORTS[0], high=DERIVED_PORTS[1]) if derived else free_port()
    coordinator = f"127.0.0.1:{port}"
    base = {**os.environ, **(env or {})}
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    start = time.monotonic()
    try:
        for pid in range(num_processes):
            p = subprocess.Popen(
                list(cmd),
                env=child_env(pid, num_processes, coordinator, local_devices, base, launcher),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            procs.append(p)
            prefix = f"[p{pid}] " if prefix_output else ""
            t = threading.Thread(target=_pump, args=(p.stdout, prefix, output, lock), daemon=True)
            t.start()
            pumps.append(t)
        result = 0
        while result == 0:
            codes = [p.poll() for p in procs]  # poll every child each round
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                result = _exit_code(failed[0])
            elif None not in codes:
                break
            elif timeout_s is not None and time.monotonic() - start > timeout_s:
                with lock:
                    output.write(f"[launch] timeout after {timeout_s}s: stopping {num_processes} processes\n")
                result = TIMEOUT_EXIT_CODE
            else:
                time.sleep(_POLL_S)
        if result and any(p.poll() is None for p in procs):
            with lock:
                output.write(f"[launch] exit code {result}: stopping the remaining processes\n")
    finally:
        _stop_all(procs, kill_grace_s)
        for t in pumps:
            t.join(timeout=5)
    return result
