"""The checkpoint callback of a `Strategy`: Orbax saves of a Keras model's weights, optimizer state and data
position, every N steps and/or every N seconds, and a ``fit`` that resumes where the newest good step left off.

A step stores the model's and the optimizer's variables (the step count is the optimizer's ``iterations``) and
the data position ``{"epoch", "position", "seed"}``: the epoch and how many of its batches were trained. A ``fit``
that runs to its end records its last step in ``keras_fit.json`` beside the steps. On ``on_train_begin`` the
newest good step is restored; if its ``fit`` was cut short, this one starts at the saved epoch (as Keras's own
``BackupAndRestore`` does) and, for a tf.data pipeline, skips the batches of that epoch already trained
(`openhosti_jax.frontends.keras.data.DataPosition`); other inputs restart the epoch from its start, with a warning.
After a finished ``fit`` a new one trains on from the restored weights and step, over its own data from its start.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from openhosti_jax.checkpoint import CheckpointManager
from openhosti_jax.errors import ConfigError
from openhosti_jax.frontends.keras._backend import keras_module

if TYPE_CHECKING:
    from openhosti_jax.frontends.keras.strategy import Strategy

FINISHED = "keras_fit.json"
"""Written beside the steps when a ``fit`` runs to its end: its last step (a later ``fit`` does not resume it)."""


def save_minutes(every_seconds: float | None, every_minutes: float | None) -> float | None:
    """One time interval in minutes from either unit (None: no time-based saves)."""
    if every_seconds is not None and every_minutes is not None:
        raise ConfigError("give every_seconds or every_minutes, not both")
    if every_seconds is not None:
        if not every_seconds > 0:
            raise ConfigError(f"expected every_seconds > 0, found {every_seconds}")
        return every_seconds / 60.0
    return every_minutes


def checkpoint_callback(
    strategy: Strategy,
    directory: str | os.PathLike[str],
    *,
    every_steps: int | None,
    every_minutes: float | None,
    keep: int | None,
    clock: Callable[[], float] = time.monotonic,
    replicate_to: str | os.PathLike[str] | None = None,
) -> Any:
    """A Keras callback saving to ``directory`` on the given schedule and resuming from it (module docstring)."""
    keras = keras_module()

    class OrbaxCheckpoint(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.manager = CheckpointManager(
                directory,
                every_minutes=every_minutes,
                every_steps=every_steps,
                keep=keep,
                clock=clock,
                replicate_to=replicate_to,
            )
            self.restored_step: int | None = None
            self.restored_data: dict[str, Any] | None = None
            """The data position the restored step was saved at."""
            self.saved_steps: list[int] = []
            self.position = strategy.data_position
            latest = self.manager.latest_good_step()
            if latest is not None and latest > self._finished_step():
                self.position.arm()  # the pipeline fit is about to be given is read through a skip
            self.epoch, self.offset, self.skip_pending = 0, 0, False
            self.mark = (0, 0)
            self.quiet: Any = None
            self.next_pass = 0
            """(epoch, batches of it trained) after the last batch or epoch: the data position a save records."""

        def _variables(self) -> list[Any]:
            return list(self.model.variables) + list(self.model.optimizer.variables)

        def _step(self) -> int:
            return int(np.asarray(self.model.optimizer.iterations.value))

        def on_train_begin(self, logs: Any = None) -> None:
            print(strategy.check(self.model), flush=True)
            if self.manager.latest_good_step() is None:
                self.position.disarm()
                return
            if not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)
            variables = self._variables()
            abstract = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.value.sharding) for v in variables]
            values, data, _ = self.manager.restore(abstract)
            for v, value in zip(variables, values, strict=True):
                v.assign(value)
            self.restored_step, self.restored_data = self.manager.restored_step, data
            epoch, position = (int(data["epoch"]), int(data["position"])) if data else (0, 0)
            if not data or self.restored_step <= self._finished_step():
                epoch, position = 0, 0
                self.position.disarm()
            self.model._initial_epoch = epoch or None  # read by fit right after on_train_begin
            self.epoch, self.offset = epoch, position
            if position and not self.position.wrapped:
                warnings.warn(
                    f"resumed at step {self.restored_step}, batch {position} of epoch {epoch}: the input is not a "
                    "tf.data pipeline, so this epoch restarts from its first batch",
                    stacklevel=2,
                )
                self.offset = 0
                self.position.disarm()
            elif position:
                steps = self.params.get("steps") or 0
                if self.position.infinite:  # one stream: this epoch's rest, then the next pass from epoch + 1
                    self.position.set(epoch * steps + position, take=steps - position)
                    self.next_pass = (epoch + 1) * steps
                else:
                    self.position.set(position)
                self.skip_pending = True
                self.quiet = warnings.catch_warnings()  # the resumed epoch ends early, as it should: not a warning
                self.quiet.__enter__()
                warnings.filterwarnings("ignore", message="Your input ran out of data")
            self.mark = (epoch, self.offset)
            print(f"resumed from step {self.restored_step} at epoch {epoch}, batch {self.offset}", flush=True)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch != self.epoch:
                self.epoch, self.offset = epoch, 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.skip_pending:  # the resumed epoch's pass has started: set up the passes after it
                self.position.disarm()
                if self.next_pass:
                    self.position.set(self.next_pass)
                self.skip_pending = False
            done = self.offset + batch + 1
            self.mark = (self.epoch, done)
            if self.params.get("steps") and done >= self.params["steps"]:
                self.mark = (self.epoch + 1, 0)  # this epoch's data is used up: a resume starts the next one
            self._save(force=False)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.epoch, self.offset, self.mark = epoch + 1, 0, (epoch + 1, 0)
            self._loud()

        def _loud(self) -> None:
            if self.quiet is not None:
                self.quiet.__exit__(None, None, None)
                self.quiet = None

        def on_train_end(self, logs: Any = None) -> None:
            self._loud()
            self._save(force=True)
            self.manager.wait()
            if jax.process_index() == 0:
                (self.manager.directory / FINISHED).write_text(json.dumps({"finished_step": self._step()}))
            self.model._initial_epoch = None

        def _finished_step(self) -> int:
            path = self.manager.directory / FINISHED
            return int(json.loads(path.read_text())["finished_step"]) if path.exists() else -1

        def _save(self, *, force: bool) -> None:
            step = self._step()
            data = {"epoch": self.mark[0], "position": self.mark[1], "seed": 0}
            if self.manager.maybe_save(step, [v.value for v in self._variables()], data_state=data, force=force):
                self.saved_steps.append(step)

    return OrbaxCheckpoint()


__all__ = ["checkpoint_callback", "save_minutes"]
