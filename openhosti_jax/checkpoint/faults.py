"""What a checkpoint that cannot be written does: checks before the first step, the failure policy, the accounting.

- **Before the first step.** `write_problem` creates the directory and writes, reads back and removes a probe file
  there (`CheckpointManager` raises `CheckpointSaveError` at construction when it fails, and probes again before
  every save, so a directory that turned read-only fails that save at once instead of inside Orbax's threads).
  `space_problem` compares the free space with two checkpoints of the state (`checkpoint_bytes`, from the
  shardings: the step being written while the last good one stays).
- **A failed save** is said at that save by `FaultLog.failed`: one log line and one `warnings.warn` (category
  `CheckpointWarning`), each naming the step, the path, the cause (the OS's errno text, `cause_of`) and the fix
  (`fix_for`); it is counted (``checkpoint_failures`` in the `Trainer`'s records). The `FailurePolicy`: training
  goes on and the next scheduled save tries again (the last good step stays), until ``max_consecutive`` saves in a
  row failed; then the run stops with that `CheckpointSaveError`, after one last attempt to save to the replica.
- **Closing** keeps the first error and adds the later ones to it as notes (`FirstError`).

Example:
    >>> import errno, tempfile
    >>> from openhosti_jax.checkpoint.faults import FaultLog, FailurePolicy, cause_of, write_problem
    >>> write_problem(tempfile.mkdtemp()) is None
    True
    >>> cause_of(OSError(errno.EROFS, "Read-only file system"))
    '[Errno 30] Read-only file system'
    >>> log = FaultLog(FailurePolicy(max_consecutive=2))
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as said:
    ...     warnings.simplefilter("always")
    ...     error = log.failed(8, "/ckpt/8", OSError(errno.ENOSPC, "No space left on device"), last_good=4)
    >>> error.step, error.path, log.count, log.must_stop()
    (8, '/ckpt/8', 1, False)
    >>> print(said[0].message)  # doctest: +ELLIPSIS
    checkpoint step 8 could not be written to /ckpt/8: [Errno 28] No space left on device; fix: free space ...
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from typing import Any

from etils import epath

from openhosti_jax.errors import CheckpointSaveError, ConfigError

_LOG = logging.getLogger("openhosti_jax.checkpoint")
LOW_SPACE = ("error", "warn", "ignore")
"""What `FailurePolicy.low_space` may say."""
_OS_CODE = re.compile(r"os_error_code='?(\d+)|\[Errno (\d+)\]")


class CheckpointWarning(UserWarning):
    """A checkpoint save failed or the disk is short of space: silence it with
    ``warnings.filterwarnings("ignore", category=CheckpointWarning)``."""


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    """What `CheckpointManager` does when a save fails or the disk is short of space."""

    max_consecutive: int | None = 3
    """Stop the run (raise `CheckpointSaveError`) after this many saves in a row failed; ``None``: never stop."""
    low_space: str = "error"
    """Free space below two checkpoints: ``"error"`` (a `CheckpointSaveError` before training), ``"warn"``
    (a `CheckpointWarning`) or ``"ignore"``."""

    def __post_init__(self) -> None:
        m = self.max_consecutive
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ConfigError(f"expected max_failures to be an int >= 1 or None (never stop), found {m!r}")
        if self.low_space not in LOW_SPACE:
            raise ConfigError(f"expected low_space in {LOW_SPACE}, found {self.low_space!r}")


def errno_of(error: BaseException | str) -> int | None:
    """The OS error number behind ``error``: an `OSError`'s, one in its chain of causes, or one its text quotes
    (TensorStore's ``os_error_code=28``, a re-raised ``[Errno 28]``)."""
    seen: set[int] = set()
    e: BaseException | None = error if isinstance(error, BaseException) else None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return int(e.errno)
        e = e.__cause__ or e.__context__
    m = _OS_CODE.search(str(error))
    return int(m.group(1) or m.group(2)) if m else None


def cause_of(error: BaseException | str) -> str:
    """``[Errno N] <the OS's text>`` where there is an OS error behind ``error``, else its type and message."""
    if isinstance(error, str):
        code = errno_of(error)
        return error if code is None or f"[Errno {code}]" in error else f"[Errno {code}] {os.strerror(code)}: {error}"
    code = errno_of(error)
    if code is not None:
        return f"[Errno {code}] {os.strerror(code)}"
    return f"{type(error).__name__}: {str(error)[:300]}"


def fix_for(code: int | None) -> str:
    """What to do about a write that failed with OS error ``code``."""
    if code == errno.EROFS:
        return "the file system is read-only: give a directory on a writable disk, or remount it read-write"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return (
            "free space on that disk (or raise the quota or `ulimit -f`), keep fewer steps (keep=), or give a "
            "directory on a larger disk"
        )
    if code in (errno.EACCES, errno.EPERM):
        return "this process may not write there: fix the permissions, or give a directory it owns"
    if code in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return "a file stands where a folder should be: remove it, or give another directory"
    return "check the disk and the directory (`df -h`, `ls -ld`); the last good step stays the one to resume from"


def write_problem(directory: str | os.PathLike[str]) -> str | None:
    """None if this process can create ``directory`` and write, read back and remove a file in it, else what failed
    (`cause_of`; `fix_for` its errno says what to do)."""
    path = epath.Path(directory)
    try:
        if path.exists() and not path.is_dir():
            return f"[Errno {errno.ENOTDIR}] {os.strerror(errno.ENOTDIR)}: {os.fspath(path)} is a file"
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".openhosti-write-probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            probe.write_bytes(b"ok")
            if probe.read_bytes() != b"ok":
                return f"[Errno {errno.EIO}] {os.strerror(errno.EIO)}: a probe file read back differently"
        finally:
            probe.unlink(missing_ok=True)
    except OSError as e:
        return cause_of(e)
    return None


def unwritable(directory: str | os.PathLike[str], problem: str) -> CheckpointSaveError:
    """The error for a checkpoint directory `write_problem` found unwritable at construction."""
    return CheckpointSaveError(
        f"expected a checkpoint directory this process can write, found {os.fspath(directory)} unwritable: "
        f"{problem}; fix: {fix_for(errno_of(problem))}. Nothing was trained yet",
        step=None,
        path=os.fspath(directory),
    )


def checkpoint_bytes(state: Any, *, whole: bool = True) -> int:
    """Bytes one checkpoint of ``state`` writes: every array whole (``whole``: one directory holds the step), or
    this process's distinct shards (its own directory), read from the shardings (no device is touched)."""
    import jax
    import numpy as np

    from openhosti_jax.sizes import itemsize

    total = 0
    for leaf in jax.tree.leaves(state):
        if not hasattr(leaf, "dtype"):
            leaf = np.asarray(leaf)
        shape, size = tuple(leaf.shape), itemsize(leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        if whole or sharding is None:
            total += size * int(np.prod(shape, dtype=np.int64))
            continue
        boxes = {
            tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(idx, shape, strict=True))
            for idx in sharding.addressable_devices_indices_map(shape).values()
        }
        total += size * sum(int(np.prod([b - a for a, b in box], dtype=np.int64)) for box in boxes)
    return total


def space_problem(directory: str | os.PathLike[str], step_bytes: int) -> str | None:
    """None if ``directory``'s disk has room for two checkpoints of ``step_bytes`` (the step being written while the
    last good one stays), else what was found; directories off this machine (``gs://``) are not measured."""
    path = os.fspath(directory)
    if "://" in path:
        return None
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    if free >= 2 * step_bytes:
        return None
    return (
        f"expected room for two checkpoints in {path} ({2 * step_bytes:,} bytes: the step being written while the "
        f"last good one stays), found {free:,} bytes free; free space there, give a directory on a larger disk, "
        "or pass low_space='warn' to train anyway"
    )


@dataclasses.dataclass(frozen=True)
class SaveFailure:
    """One failed save."""

    step: int
    path: str
    cause: str
    error: CheckpointSaveError


class FaultLog:
    """The failed saves of a run, and whether the `FailurePolicy` says to stop (thread-safe: background threads
    report failures, the training thread decides)."""

    def __init__(self, policy: FailurePolicy | None = None) -> None:
        self.policy = policy or FailurePolicy()
        self.failures: list[SaveFailure] = []
        """Every failed save, in order."""
        self.consecutive = 0
        """Saves in a row that failed (a good step resets it)."""
        self._lock = threading.Lock()
        self._raised: set[int] = set()

    @property
    def count(self) -> int:
        """How many saves failed so far (``checkpoint_failures``)."""
        return len(self.failures)

    def has_failed(self, step: int) -> bool:
        """Whether the save of ``step`` failed."""
        with self._lock:
            return any(f.step == step for f in self.failures)

    def failed(
        self, step: int, path: str | os.PathLike[str], cause: BaseException | str, *, last_good: int | None
    ) -> CheckpointSaveError | None:
        """Count the failed save of ``step`` and say so (a log line and a `CheckpointWarning`); return its error,
        or None when that step's failure was already counted."""
        path = os.fspath(path)
        text = cause_of(cause)
        with self._lock:
            if any(f.step == step for f in self.failures):
                return None
            self.consecutive += 1
            n = self.consecutive
            limit = self.policy.max_consecutive
            kept = f"the last good step {last_good} stays" if last_good is not None else "no step is good yet"
            after = (
                "the run stops now"
                if limit is not None and n >= limit
                else "training goes on and the next save tries again"
                + (f" ({n} failed in a row; {limit} stop the run)" if limit is not None else "")
            )
            message = (
                f"checkpoint step {step} could not be written to {path}: {text}; fix: {fix_for(errno_of(cause))}. "
                f"{kept.capitalize()}; {after}"
            )
            error = CheckpointSaveError(message, step=step, path=path)
            if isinstance(cause, BaseException):
                error.__cause__ = cause
            self.failures.append(SaveFailure(step, path, text, error))
        _LOG.error("%s", message)
        warnings.warn(message, CheckpointWarning, stacklevel=3)
        return error

    def succeeded(self, step: int) -> None:
        """A good step: the count of failures in a row starts again."""
        with self._lock:
            if not any(f.step == step for f in self.failures):
                self.consecutive = 0

    def must_stop(self, consecutive: int | None = None) -> bool:
        """Whether ``consecutive`` (default: this log's) failures in a row stop the run."""
        limit = self.policy.max_consecutive
        n = self.consecutive if consecutive is None else consecutive
        return limit is not None and n >= limit

    def unraised_latest(self) -> CheckpointSaveError | None:
        """The newest failure, when it is the latest save (no good step since) and not raised yet; marked raised."""
        with self._lock:
            if not self.consecutive or not self.failures:
                return None
            latest = self.failures[-1]
            if latest.step in self._raised:
                return None
            self._raised.add(latest.step)
            return latest.error

    def mark_raised(self, error: CheckpointSaveError) -> None:
        """``error`` reached the caller: `unraised_latest` does not give it again."""
        with self._lock:
            if error.step is not None:
                self._raised.add(error.step)


class FirstError:
    """Collects the errors of a sequence of clean-up calls: the first is raised, the later ones are its notes.

    Example:
        >>> keep = FirstError()
        >>> keep.run(lambda: 1 / 0); keep.run(lambda: [][1])
        >>> keep.error.__notes__
        ['then: IndexError: list index out of range']
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def add(self, error: BaseException) -> None:
        """Keep ``error`` (the first) or add it as a note to the first."""
        if self.error is None:
            self.error = error
        elif error is not self.error:
            self.error.add_note(f"then: {type(error).__name__}: {str(error)[:500]}")

    def run(self, fn: Callable[[], object]) -> None:
        """Call ``fn``; keep what it raises."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - kept, raised by raise_first
            self.add(e)

    def raise_first(self) -> None:
        """Raise the first error kept, if any."""
        if self.error is not None:
            raise self.error


def emergency_copy(
    step: int,
    replicate_to: str,
    save: Callable[[epath.Path], epath.Path],
    *,
    keep: int | None,
    key: bytes | None = None,
) -> str | None:
    """One last save of ``step`` straight to the replica when the checkpoint directory cannot be written: into a
    fresh folder under the system's temporary directory (``tempfile.mkdtemp``), checksummed, copied to
    ``replicate_to`` and removed. ``save(folder)`` writes the step into ``folder`` synchronously and returns its
    step folder. None on success, else what failed."""
    from openhosti_jax.checkpoint.checksums import record_checksums
    from openhosti_jax.checkpoint.replicate import replicate_step

    staging = tempfile.mkdtemp(prefix="openhosti-emergency-")
    try:
        step_dir = save(epath.Path(staging))
        record_checksums(step_dir, key=key)
        replicate_step(step_dir, replicate_to, keep=keep)
    except Exception as e:  # noqa: BLE001 - said to the caller, who raises or warns
        return f"{cause_of(e)} (staged in {staging})"
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return None
