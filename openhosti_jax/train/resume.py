"""`TrainerCheckpoint`: what the `Trainer` needs from a `CheckpointManager` to resume, save on schedule and stop.

It restores the latest good step (state onto the current shardings, data iterator position), saves when the policy
says so or when SIGTERM arrives (then the loop stops), and saves and waits at the end.

Example:
    >>> import tempfile
    >>> from openhosti_jax.train.resume import TrainerCheckpoint
    >>> ckpt = TrainerCheckpoint(tempfile.mkdtemp(), every_steps=10)
    >>> ckpt.manager.latest_good_step() is None
    True
    >>> ckpt.close()
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import jax

from openhosti_jax.checkpoint import CheckpointManager
from openhosti_jax.checkpoint.faults import CheckpointWarning
from openhosti_jax.errors import CheckpointSaveError
from openhosti_jax.state.init import abstract_train_state


def _data_state(data_iter: Any) -> dict[str, Any] | None:
    get = getattr(data_iter, "get_state", None)
    return get() if callable(get) else None


class TrainerCheckpoint:
    """Checkpointing for `Trainer.fit` over an `openhosti_jax.checkpoint.CheckpointManager`.

    ``meta`` (JSON-able, e.g. the plan's decision) is saved with every step; the `Trainer` adds the number of
    batches the data stream has given (``batches``), so a rollback knows where the data was. ``save_times``
    records ``(step, seconds the training thread was blocked)`` for every save. ``max_failures`` and
    ``low_space`` are the manager's failure policy (`openhosti_jax.checkpoint.faults.FailurePolicy`): a failed save
    is said and counted (`failures`, logged as ``checkpoint_failures``) and training goes on, until that many saves
    in a row failed. ``key`` signs the checksum records (HMAC-SHA256; default ``$OPENHOSTI_CHECKPOINT_KEY``).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_minutes: float | None = 15.0,
        every_steps: int | None = None,
        keep: int | None = 3,
        replicate_to: str | os.PathLike | None = None,
        meta: dict[str, Any] | None = None,
        max_failures: int | None = 3,
        low_space: str = "error",
        key: str | bytes | None = None,
    ):
        self.manager = CheckpointManager(
            directory,
            every_minutes=every_minutes,
            every_steps=every_steps or None,
            keep=keep,
            replicate_to=replicate_to,
            max_failures=max_failures,
            low_space=low_space,
            key=key,
        )
        self.meta = dict(meta or {})
        self.save_times: list[tuple[int, float]] = []
        self.resumed_from: int | None = None
        """The step the run resumed (or last rolled back) to; None for a fresh start."""
        self.resumed_meta: dict[str, Any] = {}
        """The metadata saved with that step."""
        if threading.current_thread() is threading.main_thread():
            self.manager.save_on_signal()

    def saved_meta(self) -> dict[str, Any] | None:
        """The metadata of the latest good step (e.g. the plan it was trained with), or None without one; read
        before building the state, so a resumed run can keep its plan."""
        step = self.manager.latest_good_step()
        return None if step is None else self.manager.user_meta(step)

    def _restore(self, state: Any, data_iter: Any) -> Any:
        restored, data_state, meta = self.manager.restore(abstract_train_state(state))
        if data_state is not None and callable(getattr(data_iter, "set_state", None)):
            data_iter.set_state(data_state)
        self.resumed_from = self.manager.restored_step
        self.resumed_meta = dict(meta or {})
        return restored

    @property
    def failures(self) -> int:
        """Saves that failed so far (``checkpoint_failures`` in the `Trainer`'s records)."""
        return self.manager.faults.count

    def restore_latest(self, state: Any, data_iter: Any) -> Any:
        """The latest good step restored onto ``state``'s shardings (and the iterator moved), else ``state``. With
        ``replicate_to``, the manager has already brought a newer replica step onto the local tier when it started
        (a machine that lost its local disk resumes from the replica). First the disk's free space is compared
        with two checkpoints of ``state``, before any step is trained."""
        self.manager.check_space(state)
        if self.manager.latest_good_step() is None:
            return state
        return self._restore(state, data_iter)

    def roll_back(self, state: Any, data_iter: Any) -> Any | None:
        """Like `restore_latest` after waiting for saves in flight; None when there is no good step."""
        try:
            self.manager.wait()
        except CheckpointSaveError:
            pass  # said when it failed: the rollback goes to the last good step

        if self.manager.latest_good_step() is None:
            return None
        return self._restore(state, data_iter)

    def due(self, step: int) -> bool:
        """Whether a save of ``step`` is due now (schedule or signal); the `Trainer` then fetches its metrics
        (spike checks come before saves) and calls `save`."""
        return self.manager.due(step)

    @property
    def stop_requested(self) -> bool:
        """True once a signal-forced save has committed: the loop should stop."""
        return self.manager.preempted

    def save(
        self, step: int, state: Any, data_iter: Any, meta: dict[str, Any] | None = None, force: bool = False
    ) -> bool:
        """Save ``step`` if due (or ``force``), with the iterator's position and ``meta`` added to the run's."""
        t0 = time.perf_counter()
        saved = self.manager.maybe_save(
            step, state, data_state=_data_state(data_iter), meta={**self.meta, **(meta or {})}, force=force
        )
        if saved:
            self.save_times.append((step, time.perf_counter() - t0))
        return saved

    def finish(self, step: int, state: Any, data_iter: Any, meta: dict[str, Any] | None = None) -> None:
        """Save the final step (unless already saved), wait for every save to commit, release the manager.

        When the final save fails, one last attempt saves it to the replica (where one is configured: a
        `CheckpointWarning` says so when it worked); else `CheckpointSaveError`. After the failure policy stopped the
        run nothing is saved.
        """
        try:
            if step > 0 and jax.tree.leaves(state) and self.manager.stopped is None:
                self.save(step, state, data_iter, meta, force=True)
                try:
                    self.manager.wait()
                except CheckpointSaveError as e:
                    if self.manager.replicate_to is None:
                        raise
                    why = self.manager.save_to_replica(
                        step, state, data_state=_data_state(data_iter), meta={**self.meta, **(meta or {})}
                    )
                    where = self.manager.replicate_to
                    if why is not None:
                        e.add_note(f"the last attempt to save step {step} to the replica {where} failed: {why}")
                        raise
                    warnings.warn(
                        f"{e}; the final step {step} was saved to the replica {where} instead",
                        CheckpointWarning,
                        stacklevel=2,
                    )
        except BaseException as e:
            try:
                self.close()
            except Exception as late:  # noqa: BLE001 - the first error stays the one raised
                e.add_note(f"then, while closing: {type(late).__name__}: {str(late)[:500]}")
            raise
        self.close()

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self.manager.close()
