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
import os
from collections.abc import Mapping

import jax

from openhosti_jax.errors import DistributedError

ENV_COORDINATOR = "OPENHOSTI_COORDINATOR"
ENV_NUM_PROCESSES = "OPENHOSTI_NUM_PROCESSES"
ENV_PROCESS_ID = "OPENHOSTI_PROCESS_ID"
ENV_HEARTBEAT = "OPENHOSTI_HEARTBEAT_TIMEOUT_S"
"""Seconds without a heartbeat after which the coordinator declares a process dead and the others stop."""

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
) -> bool:
    """Join the multi-process runtime if this is one process of several; return whether it is now initialised.

    Arguments override what `detect_launch` finds. A SLURM step or Open MPI job gets its coordinator from
    `jax.distributed.initialize`'s own detection (jax derives the same host and port in every process); TPU pods
    are left to jax entirely. ``heartbeat_timeout_s`` (default ``$OPENHOSTI_HEARTBEAT_TIMEOUT_S``, else jax's
    100 s) bounds how long the others run on after a process dies without closing its connections.
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
        heartbeat_timeout_s = int(os.environ[ENV_HEARTBEAT])
    try:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    except (AttributeError, ValueError):
        pass
    kwargs = {} if heartbeat_timeout_s is None else {"heartbeat_timeout_seconds": heartbeat_timeout_s}
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
