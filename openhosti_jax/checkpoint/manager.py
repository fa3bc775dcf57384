"""`CheckpointManager`: async Orbax saves on a schedule and on SIGTERM, verified restores onto any mesh.

A step holds three Orbax items: ``state`` (the training state as named arrays, typed PRNG keys as key data),
``data`` (the data iterator's JSON state) and ``meta`` (the caller's JSON metadata, e.g. the plan, plus the
mesh shape and leaf names). `maybe_save` blocks only while Orbax copies the arrays off the devices; the write,
the commit, the per-file checksums (`openhosti_jax.checkpoint.checksums`) and the optional copy to
``replicate_to`` run in the background. A step counts as *good* once its checksum record exists. `restore`
verifies the checksums before reading, names every bad array, and falls back to the previous good step.

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
import os
import signal
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding

from openhosti_jax.checkpoint.checksums import CHECKSUM_FILE, has_checksums, record_checksums, verify_checksums
from openhosti_jax.checkpoint.flat import abstract_flat, check_same_leaves, flatten_state, unflatten_state
from openhosti_jax.checkpoint.policy import SavePolicy
from openhosti_jax.checkpoint.replicate import replica_steps, replicate_step
from openhosti_jax.data.protocol import check_json_state
from openhosti_jax.errors import CheckpointCorruptError, CheckpointError

_POLL_S = 0.02
_IDLE_PER_BUSY = 3.0


def _orbax_manager(directory: epath.Path, *, async_save: bool, read_only: bool) -> Any:
    # Rotation is ours (`_rotate`), not Orbax's: Orbax deleting a step while its checksums are being written
    # could leave a checksum record over a half-deleted step, which would then look good.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    handlers = {
        # One folder per array (no OCDBT) so a damaged file maps to the array it belongs to.
        "state": ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False),
        "data": ocp.JsonCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _good_steps(root: epath.Path) -> list[int]:
    if not root.exists():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and has_checksums(p))


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
    ) -> None:
        self.policy = SavePolicy(every_minutes=every_minutes, every_steps=every_steps, keep=keep)
        self.directory = epath.Path(directory)
        self.replicate_to = None if replicate_to is None else epath.Path(replicate_to)
        self._mgr = _orbax_manager(self.directory, async_save=async_save, read_only=False)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openhosti-checkpoint")
        self._pending: list[Future[None]] = []
        self._started: set[int] = set()
        self._hurry = threading.Event()
        self._last_save = time.monotonic()
        self._signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self.preempted = False
        self.restored_step: int | None = None
        """The step the last `restore` read (after any fallback past a corrupt step)."""
        """Set once a save forced by a signal has committed: the training loop should stop."""

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
        """
        step = int(step)
        signalled = self._signal is not None
        if not (force or signalled or self.policy.due(step, time.monotonic() - self._last_save)):
            return False
        if step in self._started or step in _good_steps(self.directory):
            return False
        if (self.directory / str(step)).exists():  # committed before a crash but never checksummed
            self._mgr.reload()
            self._mgr.delete(step)
        if data_state is not None:
            check_json_state(data_state, "CheckpointManager.maybe_save(data_state=...)")
        try:
            json.dumps(meta or {})
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"expected meta to be a JSON-able dict, found {meta!r}: {e}") from e
        flat, key_impls = flatten_state(state)
        info = {
            "step": step,
            "leaves": sorted(flat),
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
        self._mgr.save(step, args=args, force=True)
        self._started.add(step)
        self._last_save = time.monotonic()
        self._pending.append(self._worker.submit(self._finish, step))
        if signalled:
            self.wait()
            self._signal, self.preempted = None, True
        return True

    def _finish(self, step: int) -> None:
        """Background: wait for the commit, write the checksum record, copy to the replica."""
        path = self.directory / str(step)
        while not path.exists():
            if not self._mgr.is_saving_in_progress() and not path.exists():
                return  # the save failed; Orbax reports it from wait()
            time.sleep(_POLL_S)
        if jax.process_index() != 0:
            return
        record_checksums(path, self._pace)
        if self.replicate_to is not None:
            replicate_step(path, self.replicate_to, keep=self.policy.keep)
        self._rotate()

    def _rotate(self) -> None:
        """Keep the newest ``keep`` good steps; drop older ones and dead (never checksummed) older folders.

        The checksum record goes first, so a kill in the middle leaves a folder that is not good, never a good
        step with missing files.
        """
        good = _good_steps(self.directory)
        if not good:
            return
        drop = set(good[: -self.policy.keep] if self.policy.keep else [])
        drop |= {
            int(p.name)
            for p in self.directory.iterdir()
            if p.name.isdigit() and int(p.name) < good[-1] and not has_checksums(p)
        }
        for step in sorted(drop):
            path = self.directory / str(step)
            (path / CHECKSUM_FILE).unlink(missing_ok=True)
            path.rmtree(missing_ok=True)

    def _pace(self, busy_s: float) -> None:
        """Background checksumming uses at most 1/(1+_IDLE_PER_BUSY) of a core, unless `wait` is hurrying it."""
        self._hurry.wait(timeout=_IDLE_PER_BUSY * busy_s)

    def due(self, step: int) -> bool:
        """Whether `maybe_save` would save ``step`` now: the policy's schedule or a signal says so (a step already
        saved or being saved is not due)."""
        step = int(step)
        if self._signal is None and not self.policy.due(step, time.monotonic() - self._last_save):
            return False
        return step not in self._started and step not in _good_steps(self.directory)

    def wait(self) -> None:
        """Block until every started save is committed, checksummed and replicated."""
        self._hurry.set()
        try:
            self._mgr.wait_until_finished()
            pending, self._pending = self._pending, []
            for f in pending:
                f.result()
        finally:
            self._hurry.clear()

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
        return _good_steps(self.directory)

    def latest_good_step(self) -> int | None:
        """The newest committed and checksummed step, or ``None``."""
        steps = self.good_steps()
        return steps[-1] if steps else None

    def verify(self, step: int) -> list[str]:
        """Every problem of ``step``'s files against its checksums (empty: intact), naming each bad array."""
        return verify_checksums(self.directory / str(int(step)))

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any] | None, dict]:
        """(state, data_state, meta) of ``step`` or of the newest step that verifies.

        ``abstract_state`` is a pytree of `jax.ShapeDtypeStruct` with the shardings to restore onto (any mesh
        or device count). Without ``step``, a corrupt step is skipped with a warning naming the bad arrays;
        then the replica is tried. Raises `CheckpointCorruptError` if nothing verifies, `CheckpointError` if
        there is no step at all or the tree does not match.
        """
        target = abstract_flat(abstract_state)
        if step is not None and not (self.directory / str(int(step))).exists():
            raise CheckpointError(
                f"no checkpoint step {step} in {self.directory}; committed and checksummed: {self.good_steps()}"
            )
        roots = [(self.directory, self._mgr)]
        if self.replicate_to is not None and step is None:
            roots.append((self.replicate_to, None))
        failures: list[str] = []
        tried = False
        for root, mgr in roots:
            candidates = [int(step)] if step is not None else _good_steps(root)[::-1]
            for s in candidates:
                tried = True
                problems = verify_checksums(root / str(s))
                if not problems:
                    reader = mgr or _orbax_manager(root, async_save=False, read_only=True)
                    try:
                        return self._restore_step(reader, s, abstract_state, target)
                    except CheckpointError:
                        raise
                    except Exception as e:  # noqa: BLE001 - any read failure of verified files: say which
                        problems = [f"Orbax failed to read it: {type(e).__name__}: {str(e)[:500]}"]
                    finally:
                        if reader is not mgr:
                            reader.close()
                failures.append(f"step {s} in {root}: " + "; ".join(problems))
                if step is None:
                    warnings.warn(f"checkpoint {failures[-1]}; falling back to the previous good step", stacklevel=2)
        if not tried:
            raise CheckpointError(
                f"no committed checkpoint in {self.directory}"
                + (f" or {self.replicate_to}" if self.replicate_to else "")
                + "; call latest_good_step() first and start from scratch when it is None"
            )
        raise CheckpointCorruptError(
            "no checkpoint step verifies against its checksums:\n  " + "\n  ".join(failures) + "\nrestore "
            "from another copy (replicate_to) or restart training"
        )

    def _restore_step(self, mgr: Any, step: int, abstract_state: Any, target: dict) -> tuple[Any, Any, dict]:
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        info = meta["openhosti"]
        check_same_leaves(info["leaves"], sorted(target), step)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        out = mgr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args=restore_args), data=ocp.args.JsonRestore()
            ),
        )
        state = unflatten_state(abstract_state, out["state"], info["key_impls"])
        self.restored_step = step
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
        """Wait for pending saves, stop the background worker, give the signal handlers back."""
        try:
            self.wait()
        finally:
            self._worker.shutdown(wait=True)
            self._mgr.close()
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
            self._old_handlers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
