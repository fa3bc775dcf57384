"""Multi-process start-up on `jax.distributed` under openhosti, torchrun, SLURM, Open MPI, Kubernetes or TPU pods.

`detect_launch` reads which launcher started this process and what it says (coordinator, process count, rank);
`initialize_distributed` joins the job. Precedence, first match wins:

=========  =====================================================================  ==============================
launcher   environment                                                            coordinator
=========  =====================================================================  ==============================
openhosti  ``OPENHOSTI_COORDINATOR`` (+ ``_NUM_PROCESSES``, ``_PROCESS_ID``)      as given
torchrun   ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``             ``MASTER_ADDR:MASTER_PORT+1``
slurm      ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,           first node of the step, port
           ``SLURM_PROCID``, ``SLURM_LOCALID`` (a task of ``srun``)               from the job id (jax's rule)
openmpi    ``OMPI_MCA_orte_hnp_uri`` + ``OMPI_COMM_WORLD_SIZE`` / ``_RANK``       mpirun's host, port from the
           (``mpirun`` of Open MPI <= 4)                                          job id (jax's rule)
jax        ``TPU_WORKER_HOSTNAMES``, ``MEGASCALE_COORDINATOR_ADDRESS``,           jax's own detection
           ``JOBSET_NAME`` without a coordinator
=========  =====================================================================  ==============================

With a coordinator given (argument, ``OPENHOSTI_COORDINATOR`` or ``JAX_COORDINATOR_ADDRESS``) but no rank, the
rank and count come from the first launcher variables present: ``RANK``/``WORLD_SIZE``, ``SLURM_PROCID``/
``SLURM_NTASKS``, ``OMPI_COMM_WORLD_RANK``/``_SIZE`` (Open MPI 5 sets no HNP URI), or ``JOB_COMPLETION_INDEX``
(an Indexed Kubernetes Job or JobSet, count from ``OPENHOSTI_NUM_PROCESSES``); see ``examples/k8s/jobset.yaml``.
A launcher saying there is one process (an ``salloc`` shell, ``srun -n1``) is a single-process run.

Process 0's coordinator listens where it is told (`coordinator_bind_address`): the address it advertises (a local
launch's ``127.0.0.1:PORT``, a cluster's ``host:PORT``), never every interface unless asked
(``OPENHOSTI_COORDINATOR_BIND=[::]:PORT``). It has no authentication: whoever reaches the port can join as a
process, read and write the key-value store the processes agree through, and end the job; keep it on the job's
private network (values read back from the store are still checked: `openhosti_jax.mesh.barrier`).

Example:
    >>> from openhosti_jax.mesh import initialize_distributed
    >>> initialize_distributed()  # a single process with no cluster environment: nothing to do
    False
    >>> from openhosti_jax.mesh.distributed import detect_launch
    >>> env = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "gpu[01-04]", "SLURM_NTASKS": "32",
    ...        "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}
    >>> detect_launch(env)
    LaunchInfo(launcher='slurm', coordinator_address=None, num_processes=32, process_id=9)
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
from collections.abc import Mapping

import jax

from openhosti_jax.errors import DistributedError

ENV_COORDINATOR = "OPENHOSTI_COORDINATOR"
ENV_NUM_PROCESSES = "OPENHOSTI_NUM_PROCESSES"
ENV_PROCESS_ID = "OPENHOSTI_PROCESS_ID"
ENV_HEARTBEAT = "OPENHOSTI_HEARTBEAT_TIMEOUT_S"
"""Seconds without a heartbeat after which the coordinator declares a process dead and the others stop."""
ENV_BIND = "OPENHOSTI_COORDINATOR_BIND"
"""Where process 0's coordinator listens (``host:port``); default: the address it advertises."""
_LOG = logging.getLogger(__name__)

_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
"""Set by torchrun (and torch.distributed.launch) for every worker."""
_SLURM_ENV = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
"""What jax's SlurmCluster needs: set for every task of an ``srun`` step."""
_OMPI_URI = "OMPI_MCA_orte_hnp_uri"
"""Set by ``mpirun`` of Open MPI up to 4.x; jax's OmpiCluster takes the coordinator host from it."""
_JAX_ONLY_ENV = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "JOBSET_NAME")
"""Cluster environments left entirely to `jax.distributed.initialize`'s own detection."""
_RANK_SOURCES = (  # (launcher, rank variable, count variable) when only a coordinator address is given
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("jobset", "JOB_COMPLETION_INDEX", ENV_NUM_PROCESSES),
)
LAUNCHER_ENV = (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    *_TORCHRUN_ENV,
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    *_SLURM_ENV,
    _OMPI_URI,
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "JOB_COMPLETION_INDEX",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_PORT",
    *_JAX_ONLY_ENV,
)
"""Every variable `detect_launch` reads: a launcher that sets up one kind of job clears the others."""


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Who started this process and what it says; ``None`` fields are left to jax's cluster detection."""

    launcher: str
    """``openhosti``, ``torchrun``, ``slurm``, ``openmpi``, ``jobset`` (coordinator + JOB_COMPLETION_INDEX),
    ``explicit`` (a coordinator without rank variables) or ``jax`` (TPU pods and the like)."""
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


def _is_initialized() -> bool:
    return jax.distributed.is_initialized()


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError as e:
        raise DistributedError(
            f"expected an integer in ${name}, found {env[name]!r}; fix the launcher's environment"
        ) from e


def _positive_int(env: Mapping[str, str], name: str) -> int:
    value = _int(env, name)
    if value < 1:
        raise DistributedError(f"expected a positive number of seconds in ${name}, found {env[name]!r}")
    return value


def _split(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"expected a coordinator address host:port (port 1-65535), found {address!r}")
    return host, port


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def coordinator_bind_address(
    coordinator_address: str, given: str | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """Where process 0's coordinator listens: ``given``, else ``$OPENHOSTI_COORDINATOR_BIND`` (or jax's
    ``$JAX_COORDINATOR_BIND_ADDRESS``), else the address it advertises: an IP address as it is, a host name as the
    address it resolves to here. None (jax's default: every interface, logged) only for a host name that resolves
    to nothing but loopback here (an ``/etc/hosts`` entry): binding there would shut the other hosts out.

    Example:
        >>> coordinator_bind_address("127.0.0.1:1234", environ={})
        '127.0.0.1:1234'
        >>> coordinator_bind_address("10.0.0.7:1234", environ={"OPENHOSTI_COORDINATOR_BIND": "[::]:1234"})
        '[::]:1234'
    """
    env = os.environ if environ is None else environ
    chosen = given or env.get(ENV_BIND) or env.get("JAX_COORDINATOR_BIND_ADDRESS")
    if chosen:
        _split(chosen)
        return chosen
    host, port = _split(coordinator_address)
    try:
        ipaddress.ip_address(host.strip("[]"))
        return f"{host}:{port}"
    except ValueError:
        pass
    if host == "localhost":
        return f"127.0.0.1:{port}"
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)}
    except OSError:
        found = set()
    usable = sorted(a for a in found if not _is_loopback(a))
    if usable:
        address = usable[0]
        return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    _LOG.warning(
        "the coordinator host %r resolves to %s here: process 0's coordinator listens on every interface (port %s); "
        "set %s=ADDRESS:%s to bind it to the job's network only",
        host,
        sorted(found) or "nothing",
        port,
        ENV_BIND,
        port,
    )
    return None


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchInfo | None:
    """The launcher of this process as read from ``environ`` (default ``os.environ``), or ``None`` when none is.

    Pure: reads the mapping only (no network, no jax calls).
    """
    env = os.environ if environ is None else environ
    coordinator = env.get(ENV_COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS")
    if coordinator:
        nproc = _int(env, ENV_NUM_PROCESSES) if ENV_NUM_PROCESSES in env else None
        pid = _int(env, ENV_PROCESS_ID) if ENV_PROCESS_ID in env else None
        launcher = "openhosti" if ENV_COORDINATOR in env else "explicit"
        if pid is None or nproc is None:
            for name, rank_var, count_var in _RANK_SOURCES:
                if rank_var in env and (count_var in env or nproc is not None):
                    pid = _int(env, rank_var) if pid is None else pid
                    nproc = _int(env, count_var) if nproc is None else nproc
                    launcher = name
                    break
        return LaunchInfo(launcher, coordinator, nproc, pid)
    if all(k in env for k in _TORCHRUN_ENV):
        port = _int(env, "MASTER_PORT") + 1  # torch's TCPStore keeps MASTER_PORT itself
        return LaunchInfo("torchrun", f"{env['MASTER_ADDR']}:{port}", _int(env, "WORLD_SIZE"), _int(env, "RANK"))
    if all(k in env for k in _SLURM_ENV):
        return LaunchInfo("slurm", None, _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"))
    if _OMPI_URI in env and "OMPI_COMM_WORLD_SIZE" in env:
        return LaunchInfo("openmpi", None, _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK"))
    if any(k in env for k in _JAX_ONLY_ENV):
        return LaunchInfo("jax", None, None, None)
    return None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 120,
    heartbeat_timeout_s: int | None = None,
    cpu_collectives: str = "gloo",
    bind_address: str | None = None,
) -> bool:
    """Join the multi-process runtime if this is one process of several; return whether it is now initialised.

    Arguments override what `detect_launch` finds. A SLURM step or Open MPI job gets its coordinator from
    `jax.distributed.initialize`'s own detection (jax derives the same host and port in every process); TPU pods
    are left to jax entirely. ``heartbeat_timeout_s`` (default ``$OPENHOSTI_HEARTBEAT_TIMEOUT_S``, else jax's
    100 s) bounds how long the others run on after a process dies without closing its connections.
    ``bind_address`` is where process 0's coordinator listens (`coordinator_bind_address`: by default the
    address it advertises, e.g. 127.0.0.1 for a local launch, never every interface unless asked).
    Must be called before any other JAX call touches the devices.
    """
    if _is_initialized():
        return True
    found = detect_launch()
    if coordinator_address is None and found is not None:
        coordinator_address = found.coordinator_address
    if found is not None:
        num_processes = found.num_processes if num_processes is None else num_processes
        process_id = found.process_id if process_id is None else process_id
    launcher = found.launcher if found is not None else "arguments"
    if found is None and coordinator_address is None:
        return False
    if num_processes == 1:
        return False  # one process: nothing to join (an salloc shell, srun -n1, a 1-pod job)
    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise DistributedError(
            f"coordinator {coordinator_address!r} given but num_processes={num_processes}, "
            f"process_id={process_id}; expected both (set {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}, or start the "
            "processes with torchrun, srun, mpirun or an Indexed Job that sets the rank)"
        )
    if heartbeat_timeout_s is None and ENV_HEARTBEAT in os.environ:
        heartbeat_timeout_s = _positive_int(os.environ, ENV_HEARTBEAT)
    if coordinator_address is None and launcher in ("slurm", "openmpi"):
        coordinator_address = _derived_coordinator(num_processes, process_id, timeout_s)
    bind = None if coordinator_address is None else coordinator_bind_address(coordinator_address, bind_address)
    try:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    except (AttributeError, ValueError):
        pass
    kwargs = {} if heartbeat_timeout_s is None else {"heartbeat_timeout_seconds": heartbeat_timeout_s}
    if bind is not None:
        kwargs["coordinator_bind_address"] = bind
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
            **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - re-raised typed, with what was tried
        raise DistributedError(
            f"jax.distributed.initialize failed (launcher={launcher}, coordinator={coordinator_address!r}, "
            f"num_processes={num_processes}, process_id={process_id}, timeout={timeout_s}s): {e}. "
            "Check that every process was started and can reach the coordinator; on Kubernetes set "
            f"{ENV_COORDINATOR} as examples/k8s/jobset.yaml does."
        ) from e
    return True


def _derived_coordinator(num_processes: int | None, process_id: int | None, timeout_s: int) -> str | None:
    """The coordinator jax derives for a SLURM step or an Open MPI job (its own rule, so every process gets the same
    host and port), or None where jax's detection cannot say."""
    try:
        from jax._src.clusters import ClusterEnv  # the detection jax.distributed.initialize runs itself

        found = ClusterEnv.auto_detect_unset_distributed_params(None, num_processes, process_id, None, None, timeout_s)
        return found[0]
    except Exception:  # noqa: BLE001 - jax then detects it again itself, and binds as it does by default
        return None
