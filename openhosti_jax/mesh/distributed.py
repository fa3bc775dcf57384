"""Multi-process start-up on `jax.distributed` (SLURM, Kubernetes, TPU pods, or explicit loopback processes).

Example:
    >>> from openhosti_jax.mesh import initialize_distributed
    >>> initialize_distributed()  # a single process with no cluster environment: nothing to do
    False
"""

from __future__ import annotations

import os

import jax

from openhosti_jax.errors import DistributedError

_CLUSTER_ENV = (
    "SLURM_JOB_ID",  # SLURM
    "OMPI_COMM_WORLD_SIZE",  # Open MPI
    "TPU_WORKER_HOSTNAMES",  # Cloud TPU pods
    "MEGASCALE_COORDINATOR_ADDRESS",  # multi-slice TPU
    "JOBSET_NAME",  # Kubernetes JobSet
)
_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
"""Set by torchrun (and torch.distributed.launch) for every worker."""
_ENV_COORD = "OPENHOSTI_COORDINATOR"
_ENV_NPROC = "OPENHOSTI_NUM_PROCESSES"
_ENV_PID = "OPENHOSTI_PROCESS_ID"


def _is_initialized() -> bool:
    return jax.distributed.is_initialized()


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 120,
    cpu_collectives: str = "gloo",
) -> bool:
    """Join the multi-process runtime if this is one process of several; return whether it is now initialised.

    Arguments default to ``OPENHOSTI_COORDINATOR`` / ``OPENHOSTI_NUM_PROCESSES`` / ``OPENHOSTI_PROCESS_ID`` (set by
    ``openhosti launch``), then to torchrun's ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` (JAX's
    coordinator listens on ``MASTER_PORT + 1``: torch's own store keeps ``MASTER_PORT``); failing those, a detected
    cluster environment (SLURM, Open MPI, TPU, Kubernetes) is left to `jax.distributed.initialize`'s own
    auto-detection. With neither, this is a no-op single-process run.
    Must be called before any other JAX call touches the devices.
    """
    if _is_initialized():
        return True
    coordinator_address = coordinator_address or os.environ.get(_ENV_COORD)
    if num_processes is None and _ENV_NPROC in os.environ:
        num_processes = int(os.environ[_ENV_NPROC])
    if process_id is None and _ENV_PID in os.environ:
        process_id = int(os.environ[_ENV_PID])
    if coordinator_address is None and all(k in os.environ for k in _TORCHRUN_ENV):
        coordinator_address = f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
        num_processes = int(os.environ["WORLD_SIZE"]) if num_processes is None else num_processes
        process_id = int(os.environ["RANK"]) if process_id is None else process_id
    explicit = coordinator_address is not None
    detected = any(k in os.environ for k in _CLUSTER_ENV)
    if not explicit and not detected:
        return False
    if explicit and (num_processes is None or process_id is None):
        raise DistributedError(
            f"coordinator {coordinator_address!r} given but num_processes={num_processes}, "
            f"process_id={process_id}; expected both (or set {_ENV_NPROC} and {_ENV_PID})"
        )
    if explicit and num_processes == 1:
        return False
    try:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    except (AttributeError, ValueError):
        pass
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
        )
    except Exception as e:  # noqa: BLE001 - re-raised typed, with what was tried
        raise DistributedError(
            f"jax.distributed.initialize failed (coordinator={coordinator_address!r}, "
            f"num_processes={num_processes}, process_id={process_id}, timeout={timeout_s}s): {e}. "
            "Check that every process was started and can reach the coordinator."
        ) from e
    return True
