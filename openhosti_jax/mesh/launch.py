"""`launch_local`: run one command as N cooperating `jax.distributed` processes on this machine (127.0.0.1).

Each child gets ``OPENHOSTI_COORDINATOR`` (a free loopback port), ``OPENHOSTI_NUM_PROCESSES`` and
``OPENHOSTI_PROCESS_ID``, which `initialize_distributed` reads, and with ``local_devices`` set, a CPU platform
with that many simulated devices. Output is streamed line by line with a ``[pK]`` prefix. When one child exits
non-zero the others get SIGTERM, then SIGKILL after ``kill_grace_s``: a dead peer never leaves the rest hanging in
a collective. Exit codes follow the shell: a child killed by signal ``S`` counts as ``128 + S``.

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
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from openhosti_jax.errors import DistributedError

ENV_COORDINATOR = "OPENHOSTI_COORDINATOR"
ENV_NUM_PROCESSES = "OPENHOSTI_NUM_PROCESSES"
ENV_PROCESS_ID = "OPENHOSTI_PROCESS_ID"
TIMEOUT_EXIT_CODE = 124
"""What `launch_local` returns when ``timeout_s`` ran out before the children finished (as coreutils timeout)."""

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(
    process_id: int,
    num_processes: int,
    coordinator: str,
    local_devices: int | None,
    base: Mapping[str, str],
) -> dict[str, str]:
    """The environment of child ``process_id``: ``base`` plus the coordinator, process id/count and devices."""
    env = dict(base)
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(process_id)
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
) -> None:
    problems = []
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

    Returns:
        0 when every process exited 0, else the exit code of the first process that failed (``128 + signal``
        for one killed by a signal), or `TIMEOUT_EXIT_CODE`.
    """
    _check_args(cmd, num_processes, local_devices, port, kill_grace_s, timeout_s)
    output = output or sys.stdout
    coordinator = f"127.0.0.1:{port or free_port()}"
    base = {**os.environ, **(env or {})}
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    start = time.monotonic()
    try:
        for pid in range(num_processes):
            p = subprocess.Popen(
                list(cmd),
                env=child_env(pid, num_processes, coordinator, local_devices, base),
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
