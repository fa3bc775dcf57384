"""Per-process local directories: multi-process checkpoints with no shared filesystem.

When the processes' checkpoint directories are not one shared folder (each host its own SSD; `directories_shared`
finds out through the coordinator), each process's Orbax writes, into its own directory, every shard it holds
once (`orbax_handlers`: all hosts primary, the first local replica of each shard), so each process can restore
its own shards from its own disk. Nothing is read from another process's folder:

- **Step.** A save's step is the same on every process (step counts are; time and signal saves are agreed by
  `CheckpointManager`'s all-gather).
- **Completion.** Each process checksums every file of its folder into its own record, then the processes
  exchange their outcome through the coordinator (`openhosti_jax.mesh.barrier.gathered`); only when every
  process recorded the step does each write `COMPLETE_MARKER` beside its record. A local step is *good* with its
  record and that marker (`openhosti_jax.checkpoint.checksums.locally_complete`); a process that died before the
  exchange leaves a folder that is not good anywhere.
- **Replica.** The replica holds one merged folder per step, the layout a shared directory would have, so it can
  be restored onto any number of hosts. Each process uploads its share (`replica_share`: the chunks of the
  shards whose lowest holder it is, its own ``array_metadatas`` file, and for process 0 every other file), then
  its record of exactly those files, last, once the coordinator says every process's share is in. A replica
  step is complete when all processes' records are there, so a reader never takes a half-copied step (or one
  mixing a crashed attempt's share with a new one) for a whole one.
- **Resume.** `resumable_steps` are the steps every process can get, from its own disk or from the replica;
  `CheckpointManager` restores the newest, each process from its local copy where that verifies and from the
  replica otherwise. A local step some process cannot get is set aside until training saves it again.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any

from etils import epath

from openhosti_jax.checkpoint.checksums import (
    COMPLETE_MARKER,
    ChunkGrid,
    device_boxes,
    read_grid,
    record_files,
)
from openhosti_jax.mesh.barrier import gathered

_ARRAY_METADATA = "state/array_metadatas/process_"
_PROBE_TIMEOUT_S = 300.0


def directories_shared(directory: str | os.PathLike[str], *, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether every process's ``directory`` is the same folder (one process: True).

    Each process writes a random token file there, the tokens are exchanged through the coordinator, and each
    looks for the others' files; the answer is the same on every process (shared only if all saw all).
    """
    import jax

    if jax.process_count() == 1:
        return True
    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    mine = directory / f".openhosti-probe-{jax.process_index()}-{token}"
    mine.write_text(token)
    try:
        tokens = gathered("checkpoint-dir-probe", token, timeout_s=timeout_s)
        sees = all((directory / f".openhosti-probe-{p}-{t}").exists() for p, t in enumerate(tokens))
        return all(gathered("checkpoint-dir-shared", sees, timeout_s=timeout_s))
    finally:
        mine.unlink(missing_ok=True)


def orbax_handlers(multiprocessing_options: Any) -> dict[str, Any]:
    """Orbax item handlers for a process's own directory: every host primary, each shard written by the first
    replica this process holds (so the folder has every shard the process holds), no replica-parallel split."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint import type_handlers

    registry = type_handlers.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False))
    )
    return {
        "state": ocp.PyTreeCheckpointHandler(
            use_ocdbt=False,
            use_compression=False,
            multiprocessing_options=multiprocessing_options,
            type_handler_registry=registry,
        ),
        "data": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing_options),
        "meta": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing_options),
    }


def mark_complete(step_dir: str | os.PathLike[str], process: int, process_count: int) -> None:
    """Write `COMPLETE_MARKER` (atomically): every process recorded this step."""
    step_dir = epath.Path(step_dir)
    tmp = step_dir / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(json.dumps({"process": process, "process_count": process_count}))
    tmp.replace(step_dir / COMPLETE_MARKER)


def _lowest_holders(shape: tuple[int, ...], sharding: Any, grid: ChunkGrid) -> dict[str, int]:
    """``{chunk file: the lowest process holding a device whose shard overlaps it}``."""
    holders: dict[str, int] = {}
    for device, box in device_boxes(shape, sharding):
        for index in grid.overlapping(box):
            key = grid.key(index)
            holders[key] = min(holders.get(key, int(device.process_index)), int(device.process_index))
    return holders


def replica_share(
    step_dir: str | os.PathLike[str],
    arrays: dict[str, tuple[tuple[int, ...], Any]],
    process: int,
    files: list[str],
) -> list[str]:
    """Which of ``files`` (this process's local step folder) ``process`` uploads to the merged replica folder.

    A chunk goes with the lowest process holding it (every holder wrote the same bytes), ``array_metadatas/
    process_<p>`` with process ``p``, every other file (metadata, data and meta items, host values) with process 0.
    ``arrays`` is ``{name: (shape, sharding)}`` of the saved `jax.Array` leaves.
    """
    owner: dict[str, int] = {}
    for name, (shape, sharding) in arrays.items():
        grid = read_grid(step_dir, name)
        if grid is None or grid.shape != tuple(shape):
            continue
        for key, p in _lowest_holders(tuple(shape), sharding, grid).items():
            owner[f"state/{name}/{key}"] = p
    for rel in files:
        if rel.startswith(_ARRAY_METADATA) and rel[len(_ARRAY_METADATA) :].isdigit():
            owner[rel] = int(rel[len(_ARRAY_METADATA) :])
    return [rel for rel in files if owner.get(rel, 0) == process]


def unrecorded_files(step_dir: str | os.PathLike[str]) -> list[str]:
    """Orbax's own files at the top of a step folder (``_CHECKPOINT_METADATA``, ``commit_success.txt``), which no
    record covers; process 0 uploads them with its share."""
    step_dir = epath.Path(step_dir)
    skip = {COMPLETE_MARKER} | {p.name for p in record_files(step_dir)}
    return sorted(p.name for p in step_dir.iterdir() if p.is_file() and p.name not in skip and ".tmp" not in p.name)


def resumable_steps(mine: list[int], remote: list[int]) -> tuple[list[int], list[int]]:
    """(The steps every process can restore, newest first; the replica's complete steps), agreed through the
    coordinator: a step counts when each process has it locally (``mine``, this process's good steps) or the
    replica has it (process 0's listing ``remote`` of the complete replica steps, so all decide on one listing)."""
    lists = [set(x) for x in gathered("checkpoint-local-steps", sorted(mine), timeout_s=_PROBE_TIMEOUT_S)]
    replica = gathered("checkpoint-replica-steps", sorted(remote), timeout_s=_PROBE_TIMEOUT_S)[0]
    union = set(replica).union(*lists)
    return sorted((s for s in union if all(s in x or s in replica for x in lists)), reverse=True), replica
