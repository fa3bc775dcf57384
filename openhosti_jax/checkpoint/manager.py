"""`CheckpointManager`: async Orbax saves on a schedule and on SIGTERM, verified restores onto any mesh.

A step holds three Orbax items: ``state`` (the training state as named arrays, typed PRNG keys as key data),
``data`` (the data iterator's JSON state) and ``meta`` (the caller's JSON metadata, e.g. the plan, plus the
mesh shape, leaf names, shapes and dtypes). `maybe_save` blocks only while Orbax copies the arrays off the
devices; the write, the commit, the checksums (`openhosti_jax.checkpoint.checksums`: each process checksums
the files it wrote, paced to leave the CPU to training) and the optional copy to ``replicate_to`` run in the
background. A step counts as *good* once every process's checksum record exists.

With several processes whose directories are not one shared folder (each host its own local SSD; found out at
construction), each process writes and checksums the shards it holds into its own directory, and the processes
agree on completion through the coordinator, not through files: see `openhosti_jax.checkpoint.local`. A restore
then takes the newest step every process can get, each from its own disk where that copy verifies and from the
replica otherwise.

`restore` first compares the step's leaves with the state being restored: a changed shape or dtype, an added,
missing or renamed leaf is a `CheckpointMismatchError` listing every difference (older steps are not tried:
they were written by the same code). Then each process verifies the files it reads (in threads, while Orbax
reads them) and the processes agree on the outcome: a damaged step is skipped with a warning naming the bad
arrays and the previous good step is tried (`CheckpointCorruptError` if none verifies). No step at all is a
plain `CheckpointError` naming the directory.

Example:
    >>> import tempfile, jax, jax.numpy as jnp
    >>> from openhosti_jax.checkpoint import CheckpointManager
    >>> state = {"w": jnp.arange(4.0), "rng": jax.random.key(0)}
    >>> with CheckpointManager(tempfile.mkdtemp(), every_steps=10) as ckpt:
    ...     ckpt.maybe_save(10, state, data_state={"epoch": 0, "position": 10, "seed": 0})
    ...     ckpt.wait()
    ...     restored, data_state, meta = ckpt.restore(jax.tree.map(
    ...         lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    True
    >>> restored["w"].tolist(), data_state["position"], ckpt.latest_good_step()
    ([0.0, 1.0, 2.0, 3.0], 10, 10)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from openhosti_jax.checkpoint.checksums import (
    check_sizes,
    default_threads,
    files_read_by,
    files_written_by,
    has_checksums,
    item_files,
    load_records,
    locally_complete,
    missing_records,
    record_checksums,
    record_files,
    verify_checksums,
)
from openhosti_jax.checkpoint.faults import (
    CheckpointWarning,
    FailurePolicy,
    FaultLog,
    FirstError,
    checkpoint_bytes,
    emergency_copy,
    space_problem,
    unwritable,
    write_problem,
)
from openhosti_jax.checkpoint.flat import (
    LeafDiff,
    Spec,
    abstract_flat,
    diff_leaves,
    flatten_state,
    leaf_names,
    saved_specs,
    stored_specs,
    target_specs,
    unflatten_state,
)
from openhosti_jax.checkpoint.local import (
    directories_shared,
    mark_complete,
    orbax_handlers,
    replica_share,
    resumable_steps,
    unrecorded_files,
)
from openhosti_jax.checkpoint.policy import SavePolicy
from openhosti_jax.checkpoint.replicate import (
    fetch_step,
    prune,
    replica_reachable,
    replica_steps,
    replicate_files,
    replicate_step,
    step_folders,
)
from openhosti_jax.checkpoint.trust import checkpoint_key, is_step_name
from openhosti_jax.data.protocol import check_json_state
from openhosti_jax.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    ConfigError,
)
from openhosti_jax.mesh.barrier import gathered

_LOG = logging.getLogger(__name__)
_POLL_S = 0.02
_IDLE_PER_BUSY = 9.0
"""Background checksumming sleeps this long per second of work: at most a tenth of a core beside training."""
_SMALL_FILE = 1 << 16
"""Files up to this size are verified before Orbax reads the step; larger ones while it reads."""
_RECORDS_TIMEOUT_S = 600.0
"""How long process 0 waits for the other processes' checksum records of a step before giving up on it."""
_AGREE_TIMEOUT_S = 3600.0
"""How long a process waits for the others' verdicts on a step (each verifies the files it reads, the large ones
while Orbax reads them), before naming the processes that never answered."""


def _orbax_manager(directory: epath.Path, *, async_save: bool, read_only: bool, shared: bool = True) -> Any:
    # Rotation is ours (`_rotate`), not Orbax's: Orbax deleting a step while its checksums are being written
    # could leave a checksum record over a half-deleted step, which would then look good.
    multiprocessing = ocp.options.MultiprocessingOptions(primary_host=0 if shared else None)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
        multiprocessing_options=multiprocessing,
        # per-process folders: each process waits for its own directories (Orbax's signal keys get the process
        # id), not for process 0's "created" signal, which raced with this process's own creation
        enable_per_process_directory_creation=not shared,
    )
    handlers = {
        # One folder per array (no OCDBT) so a damaged file maps to the array it belongs to.
        "state": ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False),
        "data": ocp.JsonCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }
    if not shared:  # each process its own folder, with every shard it holds (`openhosti_jax.checkpoint.local`)
        handlers = orbax_handlers(multiprocessing)
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _is_good(step_dir: epath.Path) -> bool:
    """Every process's record is in the folder (shared, or fetched from the replica), or this process's record and
    the marker that all processes recorded the step (a per-process local folder)."""
    return has_checksums(step_dir) or locally_complete(step_dir)


def _good_steps(root: epath.Path) -> list[int]:
    if not root.exists():
        return []
    return sorted(int(p.name) for p in root.iterdir() if is_step_name(p.name) and _is_good(p))


def _read_meta(reader: Any, step: int) -> dict[str, Any]:
    return reader.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _saved(step_dir: epath.Path, info: dict[str, Any]) -> dict[str, Spec]:
    """The specs of a step's saved leaves: from its meta, or (saved before they were recorded) its ``.zarray``."""
    if "shapes" in info:
        return saved_specs(info["shapes"], info["key_impls"])
    stored = {}
    for name in info["leaves"]:
        zarray = json.loads((step_dir / "state" / name / ".zarray").read_text())
        stored[name] = [zarray["shape"], np.dtype(jnp.dtype(zarray["dtype"])).name]
    return saved_specs(stored, info["key_impls"])


def _problems_of_all(problems: list[str]) -> list[str]:
    """Every process's problems (each process checked the files it reads), on every process (`gathered`), so that
    all of them restore the same step or fall back together; a problem another process found names it."""
    if jax.process_count() == 1:
        return problems
    found: dict[str, list[int]] = {}  # problem -> the processes that found it, in order of first report
    for p, reported in enumerate(gathered("restore-problems", problems, timeout_s=_AGREE_TIMEOUT_S)):
        for problem in reported:
            found.setdefault(problem, []).append(p)
    me = jax.process_index()
    return [x if me in ps else f"{x} (found by process {', '.join(map(str, ps))})" for x, ps in found.items()]


def _orbax_error(mgr: Any, step: int) -> BaseException | None:
    """The error Orbax's background save of ``step`` ended with, without raising it (Orbax raises it once per
    thread at its next call, which `CheckpointManager._settle` takes on the training thread)."""
    ref = getattr(mgr, "_finalize_thread", None)  # no public accessor in orbax 0.12
    thread = ref.get() if ref is not None else None
    if thread is None or getattr(thread, "step", lambda: None)() != step:
        return None
    deadline = time.monotonic() + 60.0
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return getattr(thread, "exception", None)


def _mesh_shape(state: Any) -> dict[str, int] | None:
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
    return None


class CheckpointManager:
    """Save a training state on a schedule (async), on SIGTERM and on demand; restore the latest good step.

    Args:
        directory: where steps are written (any `etils.epath` path).
        every_minutes, every_steps, keep: the `SavePolicy`.
        replicate_to: a second location that receives a copy of every good step, in the background.
        async_save: ``False`` makes every save synchronous (the call returns once the step is committed).
        agree_every: with several processes, time- and signal-triggered saves are decided together at steps
            divisible by this (a tiny all-gather there); step-count saves need no agreement.
        clock: seconds from a monotonic clock, read to decide time-based saves (tests pass a fake one).
        shared: whether every process's ``directory`` is one shared folder; ``None`` finds out (each process
            writes a token there and looks for the others', through the coordinator). ``False``: each process
            keeps its own shards in its own directory (`openhosti_jax.checkpoint.local`).
        max_failures, low_space: the `openhosti_jax.checkpoint.faults.FailurePolicy`: stop after this many saves
            in a row failed (``None``: never), and what a disk without room for two checkpoints gets.
        key: an HMAC-SHA256 key for the checksum records (default ``$OPENHOSTI_CHECKPOINT_KEY``): a record that
            fails it is corrupt (tamper evidence; without a key the CRCs catch accidents, not tampering).

    The directory is created and written to at construction (`CheckpointSaveError` if it cannot be), and again
    before every save. A failed save is said at once (a log line and a `CheckpointWarning` naming the step, the
    path, the cause and the fix), counted in `faults`, never counts as a good step and never deletes one.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_minutes: float | None = 15.0,
        every_steps: int | None = None,
        keep: int | None = 3,
        replicate_to: str | os.PathLike[str] | None = None,
        async_save: bool = True,
        agree_every: int = 10,
        clock: Callable[[], float] = time.monotonic,
        shared: bool | None = None,
        max_failures: int | None = 3,
        low_space: str = "error",
        key: str | bytes | None = None,
    ) -> None:
        self.policy = SavePolicy(every_minutes=every_minutes, every_steps=every_steps, keep=keep)
        if not (isinstance(agree_every, int) and agree_every >= 1):
            raise ConfigError(f"expected agree_every to be an int >= 1, found {agree_every!r}")
        self._key = checkpoint_key(key)
        self.faults = FaultLog(FailurePolicy(max_consecutive=max_failures, low_space=low_space))
        """The failed saves (``faults.count`` is the ``checkpoint_failures`` the `Trainer` logs)."""
        self.directory = epath.Path(directory)
        problem = self._agreed_problem("checkpoint-preflight", write_problem(self.directory))
        if problem is not None:  # before any training is spent
            raise unwritable(self.directory, problem)
        self.replicate_to = None if replicate_to is None else os.fspath(replicate_to)
        if self.replicate_to is not None:
            replica_reachable(self.replicate_to)  # credentials that do not work fail now, not at the first save
        if shared is None:
            shared = directories_shared(self.directory)
        self.shared = bool(shared) or jax.process_count() == 1
        """Whether the processes share ``directory`` (else each writes its own: no shared filesystem needed)."""
        self._excluded: set[int] = set()  # local good steps another process cannot restore (it lost its copy)
        self._found_here = False  # this process found a problem in the step being restored
        self._mgr = _orbax_manager(self.directory, async_save=async_save, read_only=False, shared=self.shared)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openhosti-checkpoint")
        self._pending: list[tuple[int, Future[None]]] = []
        self._in_flight: int | None = None  # the step Orbax is writing (its errors surface at the next call)
        self._space_checked = False
        self.stopped: CheckpointSaveError | None = None
        """The error that stopped the run (`FailurePolicy.max_consecutive` failed saves in a row), or None."""
        self._replicator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openhosti-replicate")
        self._replicating: list[Future[None]] = []
        self._to_copy: set[int] = set()
        self._copy_ok = threading.Event()
        self._copy_ok.set()
        self._copy_lock = threading.Lock()
        self.replication_lag_s: list[float] = []
        """Seconds each replicated step took to reach the replica after its local commit."""
        self.replication_failures: list[str] = []
        """Steps whose copy failed (the next good step's copy catches up)."""
        self._behind_since: float | None = None  # when the first copy failed since the replica last caught up
        self.replication_catch_ups: list[tuple[int, float]] = []
        """(step, seconds the replica lagged behind the local tier) each time it caught up after failed copies."""
        self._threads = default_threads()
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openhosti-verify")
        self._started: set[int] = set()
        self._hurry = threading.Event()
        self._clock = clock
        self._last_save = clock()
        self._signal: int | None = None
        self._decided: tuple[int, tuple[bool, bool]] | None = None
        self.agree_every = agree_every
        """With several processes, time- and signal-triggered saves are agreed at steps divisible by this."""
        self._old_handlers: dict[int, Any] = {}
        self.preempted = False
        """Set once a save forced by a signal has committed: the training loop should stop."""
        self.restored_step: int | None = None
        """The step the last `restore` read (after any fallback past a corrupt step)."""
        self.fetched_step: int | None = None
        """The replica step fetched onto the local tier at construction (it was newer than any local good step:
        a replaced machine, a lost or stale local disk), or None."""
        if not self.shared:
            self.fetched_step = self._agree_on_start()
        elif self.replicate_to is not None:
            self.fetched_step = self._fetch_newer_replica()

    # -- saving ------------------------------------------------------------------------------------------

    def maybe_save(
        self,
        step: int,
        state: Any,
        *,
        data_state: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``state`` as ``step`` if the policy says so, a signal arrived, or ``force``; True if it did.

        ``data_state`` is the iterator's `get_state()`; ``meta`` any JSON-able dict (e.g. ``{"plan": ...}``).
        After a signal-triggered save this waits for the commit and sets `preempted`.

        A save that fails is said at once and returns False (training goes on; the last good step stays);
        after ``max_failures`` failures in a row, or when the save a signal asked for fails, this makes one last
        attempt to save to the replica and raises `CheckpointSaveError` (a signal's save that reached the replica
        sets `preempted` instead).
        """
        step = int(step)
        scheduled, signalled = self._decide(step)
        if not (force or scheduled) or self.stopped is not None:
            return False
        if step in self._started or step in self.good_steps():
            return False
        if data_state is not None:
            check_json_state(data_state, "CheckpointManager.maybe_save(data_state=...)")
        try:
            json.dumps(meta or {})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"expected meta to be a JSON-able dict, found {meta!r}: {e}") from e
        self._settle()  # the previous save's outcome is known before this one is decided
        if not self._space_checked:
            self.check_space(state)
        if self.faults.must_stop(self._agreed_max(self.faults.consecutive)):
            self._give_up(step, state, data_state, meta, self.faults.failures[-1].error, signalled=signalled)
        problem = self._agreed_problem(f"checkpoint-probe-{step}", write_problem(self.directory))
        if problem is not None:  # a directory that turned read-only or full fails here, not in Orbax's threads
            error = self._save_failed(step, problem)
            if signalled or self.faults.must_stop():
                self._give_up(step, state, data_state, meta, error, signalled=signalled)
            return False
        self._excluded.discard(step)
        stale = self.directory / str(step)
        if stale.exists():  # committed before a crash but never checksummed (or set aside)
            if self.shared:  # Orbax's delete is a collective: every process sees this folder
                self._mgr.reload()
                self._mgr.delete(step)
            else:  # only this process has it: its own folder goes, records first (never a good step half deleted)
                for record in record_files(stale):
                    record.unlink(missing_ok=True)
                stale.rmtree(missing_ok=True)
                self._mgr.reload()
        args, arrays = self._save_args(step, state, data_state, meta)
        self._copy_ok.clear()  # the replica's copy threads start no new file while Orbax copies off the devices
        try:
            self._mgr.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - said and counted; the policy decides what follows
            error = self._save_failed(step, e)
            if signalled or self.faults.must_stop():
                self._give_up(step, state, data_state, meta, error, signalled=signalled)
            return False
        finally:
            self._copy_ok.set()
        self._started.add(step)
        self._in_flight = step
        self._last_save = self._clock()
        self._pending.append((step, self._worker.submit(self._finish, step, arrays)))
        if signalled:  # within the grace period: the local tier; the replica follows if time allows
            try:
                self.wait(replicas=False)
            except CheckpointSaveError as e:
                self._give_up(step, state, data_state, meta, e, signalled=True)
            self._signal, self.preempted = None, True
        return True

    def _save_args(
        self, step: int, state: Any, data_state: dict[str, Any] | None, meta: dict[str, Any] | None
    ) -> tuple[Any, dict[str, tuple[tuple[int, ...], Any]]]:
        """(Orbax's save arguments for the step, ``{name: (shape, sharding)}`` of its arrays)."""
        flat, key_impls = flatten_state(state)
        # who writes which chunk file follows from each array's sharding (see checksums.files_written_by)
        arrays = {name: (tuple(x.shape), x.sharding) for name, x in flat.items() if isinstance(x, jax.Array)}
        info = {
            "step": step,
            "leaves": sorted(flat),
            "shapes": stored_specs(flat),
            "key_impls": key_impls,
            "mesh": _mesh_shape(state),
            "device_count": jax.device_count(),
            "process_count": jax.process_count(),
            "time": time.time(),
        }
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(flat),
            data=ocp.args.JsonSave({"data_state": data_state}),
            meta=ocp.args.JsonSave({"user": meta or {}, "openhosti": info}),
        )
        return args, arrays

    # -- failures ----------------------------------------------------------------------------------------

    def check_space(self, state: Any) -> None:
        """Compare the directory's free space with two checkpoints of ``state`` (bytes this host writes, from the
        shardings): too little is a `CheckpointSaveError` (``low_space="error"``) or a `CheckpointWarning`
        (``"warn"``). The `Trainer` calls it before the first step; the first save calls it otherwise."""
        self._space_checked = True
        if self.faults.policy.low_space == "ignore":
            return
        found = space_problem(self.directory, checkpoint_bytes(state, whole=self.shared))
        problem = self._agreed_problem("checkpoint-space", found)
        if problem is None:
            return
        if self.faults.policy.low_space == "warn":
            warnings.warn(problem, CheckpointWarning, stacklevel=2)
            return
        raise CheckpointSaveError(problem + ". Nothing was trained yet", step=None, path=os.fspath(self.directory))

    def _agreed_problem(self, name: str, problem: str | None) -> str | None:
        """``problem`` on one process, else every process's, the same on all (each names the process)."""
        if jax.process_count() == 1:
            return problem
        found = [f"process {p}: {x}" for p, x in enumerate(gathered(name, problem, timeout_s=_RECORDS_TIMEOUT_S)) if x]
        return "; ".join(found) or None

    def _agreed_max(self, value: int) -> int:
        """The largest ``value`` of all processes (failures in a row: every process stops at the same save)."""
        if jax.process_count() == 1:
            return value
        return max(gathered("checkpoint-failures", value, timeout_s=_RECORDS_TIMEOUT_S))

    def _settle(self) -> None:
        """Wait for Orbax's write of the step in flight (as its next save would) and count its failure here, not
        raised raw at some later call: an Orbax error, or no committed folder."""
        step, self._in_flight = self._in_flight, None
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the step Orbax was writing failed
            if step is not None:
                self._save_failed(step, e)
            return
        primary = not self.shared or jax.process_index() == 0  # another process renames a shared step's folder
        if (
            step is not None
            and primary
            and not (self.directory / str(step)).exists()
            and not self.faults.has_failed(step)
        ):
            self._save_failed(step, "its save did not commit (no step folder after Orbax finished)")

    def _save_failed(self, step: int, cause: BaseException | str) -> CheckpointSaveError:
        """Count and say the failed save of ``step``; remove what it left (its own folder only, never a good
        step). Returns its error (the one counted first, when the step had already failed)."""
        path = self.directory / str(step)
        error = self.faults.failed(step, path, cause, last_good=self.latest_good_step())
        if error is None:
            error = next(f.error for f in self.faults.failures if f.step == step)
        if self.shared and jax.process_index() != 0:
            return error
        for leftover in (self.directory / f"{step}.orbax-checkpoint-tmp", path):
            try:
                if leftover.exists() and not _is_good(leftover):
                    leftover.rmtree(missing_ok=True)
            except OSError:
                pass  # a read-only directory keeps it; the next start's clean-up or save removes it
        return error

    def _give_up(
        self,
        step: int,
        state: Any,
        data_state: dict[str, Any] | None,
        meta: dict[str, Any] | None,
        error: CheckpointSaveError,
        *,
        signalled: bool,
    ) -> None:
        """The policy says stop (or a signal's save failed): one last attempt to save ``step`` to the replica,
        then raise ``error`` with what became of it (a signal's save that reached the replica returns)."""
        if self.replicate_to is None:
            error.add_note(f"no replica is configured (replicate_to=), so step {step} was saved nowhere")
        else:
            why = self.save_to_replica(step, state, data_state=data_state, meta=meta)
            if why is None:
                note = f"step {step} was saved to the replica {self.replicate_to} instead (restore fetches it)"
                if signalled:
                    warnings.warn(f"{error}; {note}", CheckpointWarning, stacklevel=3)
                    self._signal, self.preempted = None, True
                    self.faults.mark_raised(error)
                    return
                error.add_note(note)
            else:
                error.add_note(f"the last attempt to save step {step} to the replica {self.replicate_to} failed: {why}")
        self.stopped = error
        self.faults.mark_raised(error)
        raise error

    def save_to_replica(
        self,
        step: int,
        state: Any,
        *,
        data_state: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> str | None:
        """Save ``step`` straight to ``replicate_to``, through a temporary folder off the checkpoint directory
        (which cannot be written); None when it is there, else what failed (one process only: with several, the
        replica's steps are written share by share from the local tier)."""
        if self.replicate_to is None:
            return "no replica is configured"
        if jax.process_count() > 1:
            return "an emergency copy is made by single-process runs only"
        args, _ = self._save_args(int(step), state, data_state, meta)

        def save(folder: epath.Path) -> epath.Path:
            mgr = _orbax_manager(folder, async_save=False, read_only=False)
            try:
                mgr.save(int(step), args=args, force=True)
                mgr.wait_until_finished()
            finally:
                mgr.close()
            return folder / str(int(step))

        with self._copy_lock:  # the background copies then skip older steps
            self._to_copy.add(int(step))
        try:
            return emergency_copy(int(step), self.replicate_to, save, keep=self.policy.keep, key=self._key)
        finally:
            with self._copy_lock:
                self._to_copy.discard(int(step))

    def _committed(self, step: int, path: epath.Path) -> bool:
        """Background: wait until Orbax committed ``step`` (True) or gave up on it (False: counted and said now,
        with Orbax's error when it is there)."""
        while not path.exists():
            if not self._mgr.is_saving_in_progress() and not path.exists():
                self._save_failed(step, _orbax_error(self._mgr, step) or "its save did not commit")
                return False
            time.sleep(_POLL_S)
        return True

    def _finish(self, step: int, arrays: dict[str, tuple[tuple[int, ...], Any]]) -> None:
        """Background: wait for the commit, checksum this process's files; with several processes they agree that
        every one recorded its part (a step is good only then); process 0 then copies the step to the replica
        (per-process directories: `_finish_own`)."""
        path = self.directory / str(step)
        committed = self._committed(step, path)
        if not self.shared:
            self._finish_own(step, path, arrays, committed)
            return
        me, count = jax.process_index(), jax.process_count()
        problem = None if committed else "its save did not commit"
        if committed:
            try:
                files = files_written_by(path, arrays, me)
                record_checksums(
                    path, files, process=me, process_count=count, pace=self._pace, threads=self._threads, key=self._key
                )
            except (OSError, CheckpointError) as e:  # e.g. the disk filled up after the commit
                problem = str(self._save_failed(step, e))
        if count > 1:  # every process learns whether all recorded their part (a failed one writes no file)
            verdicts = gathered(f"checkpoint-saved-{step}", problem, timeout_s=_RECORDS_TIMEOUT_S)
            failed = [f"process {p}: {v}" for p, v in enumerate(verdicts) if v]
            if failed:
                self._save_failed(step, "not every process recorded its part: " + "; ".join(failed)[:1000])
                return
        if problem is not None:
            return
        if me == 0 and not has_checksums(path):
            self._save_failed(step, f"the checksum records of processes {missing_records(path, count)} are missing")
            return
        self.faults.succeeded(step)
        if me != 0:
            return
        if self.replicate_to is not None:  # on its own thread: neither training nor a local save waits for it
            with self._copy_lock:
                self._to_copy.add(step)  # kept by _rotate until its copy is done
            self._replicating.append(self._replicator.submit(self._replicate, path, time.monotonic()))
        self._rotate()

    def _finish_own(
        self, step: int, path: epath.Path, arrays: dict[str, tuple[tuple[int, ...], Any]], committed: bool
    ) -> None:
        """Background, per-process directories: record every file of this process's folder, agree with the others
        through the coordinator that all did, mark the step complete, then upload this process's share of the
        merged replica step (its record of that share last)."""
        me, count = jax.process_index(), jax.process_count()
        problem, record = (None if committed else "its save did not commit"), {}
        if committed:
            try:
                record = record_checksums(
                    path,
                    item_files(path),
                    process=me,
                    process_count=count,
                    pace=self._pace,
                    threads=self._threads,
                    key=self._key,
                )
            except (OSError, CheckpointError) as e:
                problem = str(self._save_failed(step, e))
        verdicts = gathered(f"checkpoint-saved-{step}", problem, timeout_s=_RECORDS_TIMEOUT_S)
        failed = {p: v for p, v in enumerate(verdicts) if v}
        if failed:  # every process counts the same failure: the step is good on none
            self._save_failed(
                step,
                "not every process recorded it in its own directory: "
                + "; ".join(f"process {p}: {v}" for p, v in failed.items())[:1000],
            )
            return
        try:
            mark_complete(path, me, count)
        except OSError as e:
            self._save_failed(step, e)
            return
        self.faults.succeeded(step)
        if self.replicate_to is not None:
            share = replica_share(path, arrays, me, sorted(record))
            with self._copy_lock:
                self._to_copy.add(step)
            self._replicating.append(self._replicator.submit(self._replicate, path, time.monotonic(), share))
        self._rotate()

    def _agree_on_start(self) -> int | None:
        """Per-process directories, on start: agree on the steps every process can restore (from its own disk or
        the replica). A local step another process cannot get is set aside (`good_steps` leaves it out; saving that
        step again replaces it), and a process without the newest agreed step fetches it from the replica, so
        `latest_good_step` is the same on every process."""
        mine = _good_steps(self.directory)
        agreed, _ = resumable_steps(mine, self.replica_steps())
        self._excluded = {s for s in mine if s not in agreed}
        if not agreed or agreed[0] in mine:
            return None
        if not self._fetch(agreed[0]):
            return None  # restore fetches it again, and falls back with the others when it fails there too
        return agreed[0]

    def _fetch_newer_replica(self) -> int | None:
        """On start: bring the newest complete replica step onto the local tier when no local good step is as new,
        so every door (Trainer, `openhosti train`, OptimizedDDP, the Keras callback) resumes from whatever
        survives through the local path it already takes."""
        remote = replica_steps(self.replicate_to)
        local = _good_steps(self.directory)
        for step in reversed(remote):  # newest first; one that cannot be fetched (a planted key) is skipped
            if local and local[-1] >= step:
                return None
            if self._fetch(step):
                return step
        return None

    def _fetch(self, step: int) -> bool:
        """Fetch the replica's ``step`` onto the local tier; False (with a warning naming why) when it fails."""
        try:
            fetch_step(self.replicate_to, step, self.directory)
        except Exception as e:  # noqa: BLE001 - a corrupt or unreachable replica step: resume from another one
            warnings.warn(
                f"could not fetch checkpoint step {step} from {self.replicate_to}: {type(e).__name__}: {str(e)[:500]}",
                CheckpointWarning,
                stacklevel=3,
            )
            return False
        self._mgr.reload()
        return True

    def _replicate(self, path: epath.Path, committed_at: float, share: list[str] | None = None) -> None:
        """Background: copy the step to the replica (``share``: this process's part of it, per-process directories);
        a failure (the store unreachable) is warned about and the next good step's copy catches up (the replica
        keeps its previous complete steps meanwhile); the lag behind the local tier is logged when it does."""
        step = int(path.name)
        with self._copy_lock:  # with a share, every process copies every step, so that each step completes
            superseded = share is None and any(s > step for s in self._to_copy)
        try:
            if share is not None:
                me = jax.process_index()
                extra = unrecorded_files(path) if me == 0 else []

                def all_uploaded(uploaded: bool) -> bool:  # every process's share is in: write the records
                    return all(gathered(f"checkpoint-replica-{step}", uploaded, timeout_s=_RECORDS_TIMEOUT_S))

                committed = replicate_files(
                    path,
                    self.replicate_to,
                    share,
                    process=me,
                    process_count=jax.process_count(),
                    unrecorded=extra,
                    before_commit=all_uploaded,
                    gate=self._gate,
                    key=self._key,
                )
                if not committed:
                    raise CheckpointError(
                        f"expected every process's share of step {step} in {self.replicate_to}, found some process's "
                        "upload failed; no record of it is written, so the replica's newest complete step stays "
                        "the previous one"
                    )
                if me == 0:  # one pruner; a step completes only once every share is in, so none is cut short
                    prune(self.replicate_to, self.policy.keep)
            elif not superseded:  # a newer good step waits to be copied: the replica needs only the newest
                replicate_step(path, self.replicate_to, keep=self.policy.keep, gate=self._gate)
        except Exception as e:  # noqa: BLE001 - replication must never stop training
            self.replication_failures.append(f"step {path.name}: {type(e).__name__}: {str(e)[:300]}")
            if self._behind_since is None:
                self._behind_since = committed_at
            warnings.warn(
                f"checkpoint step {path.name} was not replicated to {self.replicate_to} ({type(e).__name__}: "
                f"{str(e)[:200]}); the replica's newest complete step is older, and the next save tries again",
                stacklevel=1,
            )
        else:
            if not superseded:
                now = time.monotonic()
                self.replication_lag_s.append(now - committed_at)
                if self._behind_since is not None:
                    _LOG.warning(
                        "checkpoint replica %s caught up at step %d: it lagged %.1f s behind the local tier "
                        "(%d failed copies so far)",
                        self.replicate_to,
                        step,
                        now - self._behind_since,
                        len(self.replication_failures),
                    )
                    self.replication_catch_ups.append((step, now - self._behind_since))
                    self._behind_since = None
                else:
                    _LOG.info("checkpoint step %d replicated %.2f s after its local commit", step, now - committed_at)
        finally:
            with self._copy_lock:
                self._to_copy.discard(step)

    def _gate(self) -> None:
        """Called by the replica's copy threads before each file: wait (up to a minute) while `maybe_save` copies a
        new step off the devices, so the loop's save call does not share the CPU and memory bandwidth with them."""
        self._copy_ok.wait(timeout=60.0)

    def _rotate(self) -> None:
        """Keep the newest ``keep`` good steps; drop older ones and dead (never checksummed) older folders.

        The checksum records go first, so a kill in the middle leaves a folder that is not good, never a good
        step with missing files.
        """
        good = self.good_steps()
        if not good:
            return
        drop = set(good[: -self.policy.keep] if self.policy.keep else [])
        drop |= {
            int(p.name)
            for p in self.directory.iterdir()
            if is_step_name(p.name) and int(p.name) < good[-1] and (not _is_good(p) or int(p.name) in self._excluded)
        }
        with self._copy_lock:
            drop -= self._to_copy  # a step still being copied to the replica goes at a later rotation
        for step in sorted(drop):
            path = self.directory / str(step)
            for record in record_files(path):
                record.unlink(missing_ok=True)
            path.rmtree(missing_ok=True)

    def _pace(self, busy_s: float) -> None:
        """Background checksumming (all its threads together) uses about 1/_IDLE_PER_BUSY of a core, unless
        `wait` is hurrying it."""
        self._hurry.wait(timeout=_IDLE_PER_BUSY * self._threads * busy_s)

    def due(self, step: int) -> bool:
        """Whether `maybe_save` would save ``step`` now: the policy's schedule or a signal says so (a step already
        saved or being saved is not due). Every process gets the same answer (`_decide`)."""
        step = int(step)
        if not self._decide(step)[0]:
            return False
        return step not in self._started and step not in self.good_steps()

    def _decide(self, step: int) -> tuple[bool, bool]:
        """(save ``step``, a signal asked for it): the same on every process. Step counts are the same everywhere;
        clocks and signals are not, so with several processes the time and signal part is decided only at steps
        divisible by ``agree_every`` and there by all of them together (any process's clock or signal counts).
        Deciding alone, one process would enter Orbax's save while another entered the next step's collective,
        and the job would hang. Cached per step: ``due`` and ``maybe_save`` of one step agree once."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        by_steps = self.policy.due_by_steps(step)
        signalled = self._signal is not None
        timed = signalled or self.policy.due_by_time(self._clock() - self._last_save)
        if jax.process_count() > 1:
            if step % self.agree_every:
                timed = signalled = False
            else:
                flags = multihost_utils.process_allgather(np.array([timed, signalled], np.int32))
                timed, signalled = (bool(f) for f in np.asarray(flags).reshape(-1, 2).any(axis=0))
        decision = (by_steps or timed, signalled)
        self._decided = (step, decision)
        return decision

    def wait(self, *, replicas: bool = True) -> None:
        """Block until every started save is committed and checksummed (process 0: by every process) and, with
        ``replicas``, copied to the replica (a preemption's save waits only for the local tier).

        Raises `CheckpointSaveError` when the newest save failed (it was said and counted when it did; each
        failure is raised once): the latest state is then not checkpointed.
        """
        self._hurry.set()
        try:
            self._settle()
            pending, self._pending = self._pending, []
            for step, f in pending:
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 - a save whose background part raised did not complete
                    self._save_failed(step, e)
            if replicas:
                copying, self._replicating = self._replicating, []
                for f in copying:
                    f.result()
        finally:
            self._hurry.clear()
        error = self.faults.unraised_latest()
        if error is not None:
            raise error

    def save_on_signal(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        """On any of ``signals``, force a save at the next `maybe_save` call (the next step boundary).

        Call from the main thread. The previous handlers come back on `close`.
        """

        def handler(signum: int, frame: Any) -> None:
            self._signal = signum

        for sig in signals:
            try:
                self._old_handlers.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, handler)
            except ValueError as e:
                raise CheckpointError(f"save_on_signal must be called from the main thread (signal {sig}): {e}") from e

    # -- finding and restoring -----------------------------------------------------------------------------

    def good_steps(self) -> list[int]:
        """Committed, checksummed steps, ascending (not yet verified against their checksums)."""
        return [s for s in _good_steps(self.directory) if s not in self._excluded]

    def latest_good_step(self) -> int | None:
        """The newest committed and checksummed step, or ``None``."""
        steps = self.good_steps()
        return steps[-1] if steps else None

    def verify(self, step: int) -> list[str]:
        """Every problem of ``step``'s files against its checksums (empty: intact), naming each bad array.

        Checks every file of the step (all processes' records), ``threads`` files at a time.
        """
        step_dir = self.directory / str(int(step))
        record, problems = load_records(step_dir, self._key)
        return problems or verify_checksums(step_dir, record=record, threads=self._threads)

    def restore(
        self, abstract_state: Any, step: int | None = None, *, partial: bool = False, verify: bool = True
    ) -> tuple[Any, dict[str, Any] | None, dict]:
        """(state, data_state, meta) of ``step`` or of the newest good step that verifies.

        ``abstract_state`` is a pytree of `jax.ShapeDtypeStruct` or arrays with the shardings to restore onto
        (any mesh or device count). Its leaves must match the checkpoint's (names, shapes, dtypes), else
        `CheckpointMismatchError` lists every difference. With ``partial=True`` the leaves the checkpoint lacks
        keep the values passed in (so give concrete arrays for them, e.g. the freshly initialised state) and
        the checkpoint's leaves the state lacks are not read; a changed shape or dtype still raises.

        Each process verifies the files it reads against the checksums, in threads while Orbax reads them; the
        state is returned once both are done and every process found its files intact (``verify=False`` skips
        the checksums, e.g. to time the read alone).
        Without ``step``, a corrupt step is skipped with a warning naming the bad arrays; then the replica is
        tried. A ``step`` the local tier lacks or holds corrupt is fetched from the replica where it has it.
        Raises `CheckpointCorruptError` if nothing verifies, `CheckpointError` if there is no step.
        """
        target = abstract_flat(abstract_state)
        wanted = target_specs(abstract_state, target)
        concrete = {
            n: x
            for n, x in zip(leaf_names(abstract_state), jax.tree.leaves(abstract_state), strict=True)
            if isinstance(x, jax.Array)
        }
        local, remote = self._restore_candidates(step)
        # newest step first; a step's local copy before its replica, which is fetched (onto this machine's tier)
        # when the local copy is missing (a replaced machine) or does not verify. Per-process directories: in the
        # first round each process reads its own copy and fetches the step only if it has none; in the second
        # (when some process's copy failed) those whose own copy failed fetch the replica's
        steps = sorted(set(local) | set(remote), reverse=True)
        attempts = [
            (s, r)
            for s in steps
            for r in (False, True)
            if (not r and (s in local or not self.shared)) or (r and s in remote)
        ]
        if not attempts:
            raise CheckpointError(self._nothing_to_restore())
        failures: list[str] = []
        for i, (s, fetch) in enumerate(attempts):
            if (fetch and (self.shared or self._found_here)) or (not fetch and s not in local):
                try:
                    fetch_step(self.replicate_to, s, self.directory)
                except Exception as e:  # noqa: BLE001 - the others go on with the check: this copy then fails it
                    warnings.warn(f"could not fetch checkpoint step {s} from {self.replicate_to}: {e}", stacklevel=2)
                self._mgr.reload()
            self._found_here = False
            older = [a for a, _ in attempts[i + 1 :] if a != s]
            problems, meta, checking = self._check_step(
                self._mgr, self.directory, s, target, wanted, concrete if partial else None, verify, older
            )
            if not problems:  # every process reads (Orbax's collectives) or none does
                restored, failed = None, None
                try:  # while `checking` verifies the array files; nothing is returned before it is done
                    restored = self._restore_step(self._mgr, s, abstract_state, target, meta, concrete)
                except CheckpointError:
                    raise
                except Exception as e:  # noqa: BLE001 - a read failure of intact files: say which
                    failed = f"Orbax failed to read it: {type(e).__name__}: {str(e)[:500]}"
                late = checking.result() if checking is not None else []
                problems = self._agree_problems(late or ([failed] if failed else []))
                if not problems:
                    self.restored_step = s
                    return restored
                del restored
            where = f"the replica {self.replicate_to}" if fetch else str(self.directory)
            failures.append(f"step {s} in {where}: " + "; ".join(problems))
            if step is None:
                warnings.warn(f"checkpoint {failures[-1]}; falling back to the previous good copy", stacklevel=2)
        raise CheckpointCorruptError(
            "expected a checkpoint step whose files match their checksums, found none:\n  "
            + "\n  ".join(failures)
            + "\nrestore from another copy (replicate_to) or restart training"
        )

    def _restore_candidates(self, step: int | None) -> tuple[list[int], list[int]]:
        """(steps to read from this process's directory, steps to fetch from the replica): with per-process
        directories, only steps every process can get (`openhosti_jax.checkpoint.local.resumable_steps`)."""
        if self.shared:
            if step is None:
                return self.good_steps(), self.replica_steps()
            s = int(step)
            here, remote = (self.directory / str(s)).exists(), [s] if s in self.replica_steps() else []
            if not here and not remote:
                raise CheckpointError(
                    f"expected checkpoint step {step} in {self.directory} or its replica, found no such folder; "
                    f"committed and checksummed steps there: {self.good_steps()}, in the replica: "
                    f"{self.replica_steps()}"
                )
            return ([s] if here else []), remote
        mine = self.good_steps()
        agreed, remote = resumable_steps(mine, self.replica_steps())
        if step is not None:
            if int(step) not in agreed:
                raise CheckpointError(
                    f"expected checkpoint step {step} on every process (its directory {self.directory} or the "
                    f"replica {self.replicate_to}), found the steps every process can get: {agreed}"
                )
            agreed = [int(step)]
        return [s for s in agreed if s in mine], [s for s in agreed if s in remote]

    def _agree_problems(self, problems: list[str]) -> list[str]:
        """`_problems_of_all`, noting whether this process found any (it then fetches the replica's copy)."""
        self._found_here = self._found_here or bool(problems)
        return _problems_of_all(problems)

    def _nothing_to_restore(self) -> str:
        where, found = [self.directory], []
        if not self.directory.exists():
            found.append(f"{self.directory} does not exist")
        else:
            folders = sorted(int(p.name) for p in self.directory.iterdir() if is_step_name(p.name))
            found.append(
                f"{self.directory} has step folders {folders} but none has all its checksum records (saves that "
                "never finished)"
                if folders
                else f"{self.directory} has no step folders"
            )
        if self.replicate_to is not None:
            where.append(self.replicate_to)
            folders = step_folders(self.replicate_to)
            if folders is None:
                found.append(f"{self.replicate_to} does not exist")
            else:
                found.append(
                    f"{self.replicate_to} has step folders {folders} but none is a complete copy"
                    if folders
                    else f"{self.replicate_to} has no step folders"
                )
        return (
            f"expected a committed checkpoint in {' or '.join(str(r) for r in where)}, found no committed "
            "checkpoint: "
            + "; ".join(found)
            + "; check the directory, or call latest_good_step() first and start from scratch when it is None"
        )

    def _check_step(
        self,
        reader: Any,
        root: epath.Path,
        step: int,
        target: dict[str, jax.ShapeDtypeStruct],
        wanted: dict[str, Spec],
        concrete: dict[str, jax.Array] | None,
        verify: bool,
        older: list[int],
    ) -> tuple[list[str], dict[str, Any], Future[list[str]] | None]:
        """(the problems of all processes, meta, the running verification of the large files this process reads).

        ``concrete`` (only with ``partial=True``): the arrays passed in, which leaves the checkpoint lacks keep.

        Raises `CheckpointMismatchError` if the step's leaves do not fit ``target``: checked on the verified
        ``meta`` item before the arrays are verified, so a changed model never reads as a corrupt checkpoint.
        """
        step_dir = root / str(step)
        record, problems = load_records(step_dir, self._key) if verify else ({}, [])
        meta: dict[str, Any] = {}
        if not problems and verify:  # every meta file, recorded or not (one the record does not list is refused)
            metas = {r for r in set(record) | set(item_files(step_dir)) if r.startswith("meta/")}
            problems = verify_checksums(step_dir, sorted(metas), record=record)
        problems = self._agree_problems(problems)  # every process passes the same ones (each call an exchange)
        if problems:
            return problems, meta, None
        try:
            meta = _read_meta(reader, step)
            saved = _saved(step_dir, meta["openhosti"])
        except Exception as e:  # noqa: BLE001 - verified or not, unreadable metadata is a damaged step
            problems = [f"its metadata is unreadable ({type(e).__name__}: {str(e)[:300]})"]
        if not problems:
            diff = diff_leaves(saved, wanted)
            if diff.blocks(partial=concrete is not None):
                raise CheckpointMismatchError(self._mismatch_message(reader, root, step, diff, wanted, older))
            shapes_only = [n for n in diff.added if n not in (concrete or {})]
            if shapes_only:
                raise CheckpointMismatchError(
                    f"restore(..., partial=True) keeps the values passed in for the leaves checkpoint step {step} "
                    f"lacks, so expected arrays for them, found only shapes (jax.ShapeDtypeStruct) for "
                    f"{shapes_only}; pass the freshly initialised state (arrays) as abstract_state, at least for "
                    "those leaves"
                )
            if verify:
                reads = {n: (tuple(t.shape), t.sharding) for n, t in target.items() if n in saved}
                files = files_read_by(step_dir, reads, set(record) | set(item_files(step_dir)))
                # sizes and the small (metadata) files first: Orbax is never fed a truncated or missing file,
                # and the large files are checksummed while Orbax reads them
                small = {f for f in files if record.get(f, [0])[0] <= _SMALL_FILE}
                problems = check_sizes(step_dir, files, record) or verify_checksums(step_dir, small, record=record)
                problems = self._agree_problems(problems)
                if not problems:
                    large = [f for f in files if f not in small]
                    checking = self._verifier.submit(
                        verify_checksums, step_dir, large, record=record, threads=self._threads
                    )
                    return problems, meta, checking
                return problems, meta, None
        return self._agree_problems(problems), meta, None

    def _mismatch_message(
        self,
        reader: Any,
        root: epath.Path,
        step: int,
        diff: LeafDiff,
        wanted: dict[str, Spec],
        older: list[int],
    ) -> str:
        lines = [
            f"expected checkpoint step {step} in {root} to hold the leaves of the state being restored, found "
            f"differences (leaf names as the checkpoint stores them):",
            diff.describe(),
        ]
        fitting, other = [], []
        for s in older:
            try:
                fits = not diff_leaves(_saved(root / str(s), _read_meta(reader, s)["openhosti"]), wanted)
            except Exception:  # noqa: BLE001 - an unreadable older step simply is not offered
                continue
            (fitting if fits else other).append(s)
        if other:
            lines.append(f"the older good steps {sorted(other)} do not match either; they were not tried")
        if fitting:
            lines.append(f"the older good steps {sorted(fitting)} match: restore(..., step={max(fitting)}) reads one")
        fixes = []
        if diff.changed:
            fixes.append(
                "a leaf saved with another shape or dtype cannot be restored into: restore with the model and "
                "optimizer configuration that saved the checkpoint, then convert"
            )
        if diff.added:
            fixes.append(
                "for the added leaves, restore(state, partial=True) with concrete arrays for them (e.g. the "
                "freshly initialised state) restores every other leaf and keeps their values"
            )
        if diff.removed:
            fixes.append(
                "restore(..., partial=True) leaves out the checkpoint's leaves the state lacks"
                + ("; a renamed leaf is better renamed back" if diff.renamed else "")
            )
        lines.append("fix: " + "; ".join(fixes))
        return "\n".join(lines)

    def _restore_step(
        self,
        mgr: Any,
        step: int,
        abstract_state: Any,
        target: dict[str, jax.ShapeDtypeStruct],
        meta: dict[str, Any],
        concrete: dict[str, jax.Array],
    ) -> tuple[Any, Any, dict]:
        info = meta["openhosti"]
        stored = set(info["leaves"])
        reads = {n: t for n, t in target.items() if n in stored}
        restore_args = ocp.checkpoint_utils.construct_restore_args(reads)
        out = mgr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    reads, restore_args=restore_args, partial_restore=len(reads) < len(stored)
                ),
                data=ocp.args.JsonRestore(),
            ),
        )
        flat = dict(out["state"]) | {n: concrete[n] for n in target if n not in stored}  # partial: kept
        state = unflatten_state(abstract_state, flat, info["key_impls"])
        return state, out["data"]["data_state"], meta["user"]

    def user_meta(self, step: int) -> dict[str, Any]:
        """The caller's ``meta`` saved with ``step`` (e.g. the plan), read without the arrays."""
        return self._mgr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]["user"]

    def checkpoint_info(self, step: int) -> dict[str, Any]:
        """What the library recorded with ``step``: leaf names, mesh shape, device/process count, time."""
        return self._mgr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]["openhosti"]

    def replica_steps(self) -> list[int]:
        """Steps present in ``replicate_to`` (empty without one)."""
        return [] if self.replicate_to is None else replica_steps(self.replicate_to)

    # -- lifetime --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending saves, stop the background workers, give the signal handlers back. Raises the first
        error met (the others are its notes): `CheckpointSaveError` when the newest save failed and was not
        raised yet."""
        first = FirstError()
        first.run(self.wait)
        first.run(lambda: self._worker.shutdown(wait=True))
        first.run(lambda: self._replicator.shutdown(wait=True))
        first.run(lambda: self._verifier.shutdown(wait=True))
        first.run(self._mgr.close)
        for sig, old in self._old_handlers.items():
            first.run(lambda sig=sig, old=old: signal.signal(sig, old))
        self._old_handlers.clear()
        first.raise_first()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        try:
            self.close()
        except Exception as e:
            if not isinstance(error, BaseException):
                raise
            error.add_note(f"while closing the checkpoint manager: {type(e).__name__}: {str(e)[:500]}")
