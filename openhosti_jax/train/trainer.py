"""`Trainer`: the loop around an ``@spmd`` step: progress, metric writers, checkpoints, eval, spikes, clean Ctrl-C.

Metrics stay on the device until the logging interval (``log_every``), a save or the end: the loop never waits for
a step to finish. Each record then gets its step's metrics, the interval's mean step time, tokens/s, the learning
rate and the running count of skipped non-finite steps. A step whose update is not finite leaves the state as it
was (`openhosti_jax.state.guard`) and does not count towards ``num_steps``; ``max_nonfinite`` of them in a row end
the run with `openhosti_jax.errors.NonFiniteError` (naming the step and the last finite loss); a loss spike
(`openhosti_jax.train.spikes.LossSpikePolicy`) rolls back to the last good checkpoint and skips its batches.

Example:
    >>> import jax, jax.numpy as jnp, optax, tempfile, os
    >>> import openhosti_jax as oh
    >>> mesh = oh.build_mesh(oh.MeshConfig(data=-1))
    >>> state, plan = oh.create_train_state(lambda r: {"w": jnp.zeros((4, 1))}, optax.sgd(0.1), mesh)
    >>> @oh.spmd(mesh=mesh, plan=plan)
    ... def step(state, batch):
    ...     loss, g = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"] - 1.0) ** 2))(state.params)
    ...     return state.apply_gradients(grads=g), {"loss": loss}
    >>> batches = [{"x": jnp.ones((8, 4))}] * 3
    >>> result = oh.Trainer(step, progress=False).fit(state, batches, num_steps=3)
    >>> int(result.state.step), len(result.history), result.history[-1]["step"]
    (3, 3, 3)
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from openhosti_jax.data.position import CountingIterator, restartable
from openhosti_jax.errors import ConfigError, NonFiniteError, StateError
from openhosti_jax.sharding.batch import batch_leaves
from openhosti_jax.state.layout import step_of
from openhosti_jax.train.metrics import MetricsLog, to_python
from openhosti_jax.train.profiling import ProfileWindow
from openhosti_jax.train.spikes import LossSpikePolicy
from openhosti_jax.train.writers import MetricWriter


@dataclasses.dataclass
class FitResult:
    """What `Trainer.fit` returns."""

    state: Any
    """The final state (after the last completed step)."""
    history: list[dict[str, Any]]
    """One metrics record per step run (a skipped non-finite step has ``skipped_nonfinite`` 1 and the step number
    it did not advance); steps rolled back after a loss spike are removed."""
    interrupted: bool = False
    """True when Ctrl-C (or SIGTERM through the checkpoint manager) ended the run early."""
    eval_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One record per evaluation: ``step`` and ``eval_<metric>`` means over the eval batches."""
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """What the loop did besides stepping: ``resumed`` (step, steps left) and ``spike`` (with the rollback)."""
    skipped_nonfinite: int = 0
    """Steps whose update was not finite and was not applied (this run)."""


def _default_tokens(batch: Any) -> int:
    leaves = [x for x, f in zip(jax.tree.leaves(batch), batch_leaves(batch), strict=True) if f]  # keys aside
    if not leaves:
        return 0
    first = leaves[0]
    return int(np.prod(np.shape(first)[:2])) * (jax.process_count() if not isinstance(first, jax.Array) else 1)


def injected_learning_rate(state: Any) -> Any:
    """The ``learning_rate`` an ``optax.inject_hyperparams`` optimizer holds in ``state`` (a device scalar), or
    None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        if "hyperparams" in names and names[-1] == "learning_rate":
            return leaf
    return None


@dataclasses.dataclass
class _Pending:
    batch: int
    """The batch's number in the data stream (1-based, counting skipped batches)."""
    metrics: Any
    tokens: int


@dataclasses.dataclass
class _Loop:
    """The running state of one `Trainer.fit`, shared by its steps, metric flushes and rollbacks."""

    state: Any
    """The training state after the last dispatched step."""
    data_iter: Iterator[Any]
    num_steps: int
    result: FitResult
    watch: Any
    """The loss-spike watch, or None."""
    bar: Any
    """The progress bar."""
    writers: list[MetricWriter]
    applied: int
    """Optimizer steps the state has taken, counted up to the last fetched metrics."""
    batch_no: int
    """The number of the last batch drawn from the data stream (1-based, skipped batches counted)."""
    pending: list[_Pending] = dataclasses.field(default_factory=list)
    """Dispatched steps whose metrics are still on the device."""
    skip: set[int] = dataclasses.field(default_factory=set)
    """Batch numbers a rollback skips."""
    rollbacks: int = 0
    nonfinite_run: int = 0
    """Non-finite (skipped) steps in a row."""
    last_finite_loss: float | None = None
    stop: Exception | None = None
    """An error that ends the loop once the metrics being written are written."""
    t_flush: float = dataclasses.field(default_factory=time.perf_counter)
    """When the metrics were last fetched (the interval's mean step time starts there)."""


class Trainer:
    """Runs ``step(state, batch) -> (state, metrics)`` over a data iterator.

    Args:
        step: the train step (an ``@spmd`` step, or any callable).
        metrics_path: a JSONL file for the records (shorthand for a `JsonlWriter` in ``writers``).
        writers: more `openhosti_jax.train.writers.MetricWriter` s (TensorBoard, wandb).
        progress: show a progress bar (process 0).
        log_every: fetch metrics from the device and write them every this many steps.
        tokens_in_batch: tokens of a batch, for tokens/s.
        checkpoint: a `TrainerCheckpoint` (or anything with its methods): the run resumes from its latest good
            step, saves on its schedule and at the end; the loop stops after a SIGTERM-forced save.
        learning_rate: a float or an optax schedule ``count -> lr``, logged as ``lr`` (without it, the
            ``learning_rate`` of an ``optax.inject_hyperparams`` optimizer is logged at each interval).
        eval_step: ``eval_step(state, batch) -> metrics`` for ``fit(eval_data=...)``; with an ``@spmd`` step it is
            jitted under the same plan, without donation.
        spikes: a `LossSpikePolicy`: spikes roll back to the last good checkpoint (needs ``checkpoint``).
        profile: a `ProfileWindow`: a ``jax.profiler`` trace of those steps.
        max_nonfinite: this many non-finite (skipped) steps in a row stop the run with `NonFiniteError`
            (``None``: never); a run whose every update is NaN would otherwise never end.
    """

    def __init__(
        self,
        step: Callable[[Any, Any], tuple[Any, Any]],
        *,
        metrics_path: str | os.PathLike | None = None,
        writers: Sequence[MetricWriter] = (),
        progress: bool = True,
        log_every: int = 10,
        tokens_in_batch: Callable[[Any], int] = _default_tokens,
        checkpoint: Any | None = None,
        learning_rate: float | Callable[[int], Any] | None = None,
        eval_step: Callable[[Any, Any], Any] | None = None,
        spikes: LossSpikePolicy | None = None,
        profile: ProfileWindow | None = None,
        max_nonfinite: int | None = 100,
    ):
        if log_every < 1:
            raise ConfigError(f"log_every must be >= 1, found {log_every}")
        if max_nonfinite is not None and (
            isinstance(max_nonfinite, bool) or not isinstance(max_nonfinite, int) or max_nonfinite < 1
        ):
            raise ConfigError(f"expected max_nonfinite to be an int >= 1 or None (never stop), found {max_nonfinite!r}")
        if spikes is not None and checkpoint is None:
            raise ConfigError(
                "Trainer(spikes=...) rolls back to the last good checkpoint, but no checkpoint was given; pass "
                "checkpoint=openhosti_jax.TrainerCheckpoint(directory, every_steps=N)"
            )
        self.step = step
        self.metrics_path = metrics_path
        self.writers = list(writers)
        self.progress = progress and jax.process_index() == 0
        self.log_every = log_every
        self.tokens_in_batch = tokens_in_batch
        self.checkpoint = checkpoint
        self.learning_rate = learning_rate
        self.eval_step = eval_step
        self.spikes = spikes
        self.profile = profile
        self.max_nonfinite = max_nonfinite
        self._eval_fn: Callable[[Any, Any], Any] | None = None

    # -- description --------------------------------------------------------------------------------------

    def _describe(self) -> str:
        plan = getattr(self.step, "plan", None)
        extra = getattr(self.step, "progress_note", None)
        parts = []
        if plan is not None:
            parts.append(f"zero{plan.zero_stage} " + "x".join(str(v) for v in plan.mesh_shape.values()))
        if callable(extra):
            note = extra()
            if note:
                parts.append(note)
        return " ".join(parts)

    def _postfix(self, record: dict[str, Any]) -> str:
        parts = []
        if isinstance(record.get("loss"), float):
            parts.append(f"loss={record['loss']:.4f}")
        dt = record.get("step_time_s") or 0.0
        if dt > 0:
            parts.append(f"{1 / dt:.2f} step/s")
            parts.append(f"{record.get('tokens_per_s') or 0:,.0f} tok/s")
        if record.get("skipped_total"):
            parts.append(f"skipped={record['skipped_total']}")
        parts.append(self._describe())
        return " ".join(p for p in parts if p)

    def _say(self, text: str) -> None:
        if self.progress:
            tqdm.write(text)

    # -- data -----------------------------------------------------------------------------------------------

    def _data(self, data: Iterable[Any]) -> Iterator[Any]:
        stateful = callable(getattr(data, "get_state", None)) and callable(getattr(data, "set_state", None))
        if stateful:
            return iter(data)
        if self.checkpoint is None and self.spikes is None:
            return iter(data)
        if self.spikes is not None and not restartable(data):
            raise StateError(
                f"Trainer(spikes=...) replays the batches after the last checkpoint, but the data is a one-shot "
                f"{type(data).__name__} without get_state()/set_state(); pass a list, a dataset object that "
                "iterates again, or openhosti_jax.data.ArrayDataset"
            )
        if not isinstance(data, Sequence):
            warnings.warn(
                f"the data ({type(data).__name__}) has no get_state()/set_state(): its position is saved as a batch "
                "count and a resumed run skips that many batches, which is exact only if it yields the same "
                "batches in the same order every time (give it a get_state()/set_state() to avoid the skipping)",
                stacklevel=3,
            )
        return CountingIterator(data)

    # -- eval -----------------------------------------------------------------------------------------------

    def _evaluate(self, state: Any, eval_data: Any, step: int) -> dict[str, Any]:
        if self._eval_fn is None:
            evaluator = getattr(self.step, "evaluator", None)
            self._eval_fn = evaluator(self.eval_step) if callable(evaluator) else jax.jit(self.eval_step)
        source = eval_data() if callable(eval_data) and not hasattr(eval_data, "__iter__") else eval_data
        rewind = getattr(source, "get_state", None)
        start = rewind() if callable(rewind) else None
        sums: dict[str, float] = {}
        count = 0
        outputs = [self._eval_fn(state, batch) for batch in source]
        for out in jax.device_get(outputs):
            for k, v in to_python(out).items():
                if isinstance(v, int | float) and v is not None:
                    sums[k] = sums.get(k, 0.0) + float(v)
            count += 1
        if start is not None:
            source.set_state(start)
        if count == 0:
            raise StateError("the eval data gave no batches; pass a list or a dataset with at least one batch")
        return {"step": step, **{f"eval_{k}": v / count for k, v in sums.items()}, "eval_batches": count}

    def _check_eval(self, eval_data: Any, eval_every: int | None) -> None:
        if eval_data is None:
            return
        if self.eval_step is None:
            raise ConfigError("fit(eval_data=...) needs Trainer(eval_step=fn) with fn(state, batch) -> metrics")
        if eval_every is not None and eval_every < 1:
            raise ConfigError(f"eval_every must be >= 1, found {eval_every}")
        stateful = callable(getattr(eval_data, "get_state", None))
        if not (callable(eval_data) or stateful or restartable(eval_data)):
            raise StateError(
                f"eval_data is a one-shot {type(eval_data).__name__}, which would be empty at the second "
                "evaluation; pass a list, a dataset with get_state()/set_state(), or a function returning a fresh "
                "iterator"
            )

    # -- the loop -------------------------------------------------------------------------------------------

    def _learning_rate(self, state: Any, step: int, last: bool) -> float | None:
        if self.learning_rate is None:
            found = injected_learning_rate(state) if last else None
            return None if found is None else float(found)
        lr = self.learning_rate(max(step - 1, 0)) if callable(self.learning_rate) else self.learning_rate
        return float(lr)

    def fit(
        self,
        state: Any,
        data: Iterable[Any],
        num_steps: int,
        *,
        eval_data: Any = None,
        eval_every: int | None = None,
    ) -> FitResult:
        """Train until the state has taken ``num_steps`` optimizer steps (a resumed state continues from its
        count), or the data ends, or Ctrl-C. ``state`` is any pytree the step takes; its step count is its
        ``step`` field or optax's ``count`` (`openhosti_jax.state.layout.step_of`), else the resumed checkpoint's
        step. ``eval_data`` (a list, a resumable dataset, or a function returning batches) is evaluated every
        ``eval_every`` steps and at the end."""
        self._check_eval(eval_data, eval_every)
        loop = self._start(state, data, num_steps)
        failed: BaseException | None = None
        try:
            while loop.applied + len(loop.pending) < num_steps and self._run_batch(loop, eval_data, eval_every):
                pass
        except KeyboardInterrupt:
            loop.result.interrupted = True
        except BaseException as e:
            failed = e
            raise
        finally:
            try:
                self._close(loop)
            except Exception as late:
                if failed is None:
                    raise
                # the error that stopped the loop stays the one raised (a failing save at the end is its note)
                failed.add_note(f"then, while closing: {type(late).__name__}: {str(late)[:500]}")
        result = loop.result
        if (
            eval_data is not None
            and not result.interrupted
            and (not result.eval_history or result.eval_history[-1]["step"] != loop.applied)
        ):
            self._eval_record(loop, eval_data)
        for w in loop.writers:
            w.close()
        result.state = loop.state
        return result

    def _start(self, state: Any, data: Iterable[Any], num_steps: int) -> _Loop:
        """The loop's state at the start: resumed from the checkpoint's latest good step where there is one."""
        data_iter = self._data(data)
        batch_no = 0
        events: list[dict[str, Any]] = []
        if self.checkpoint is not None:
            state = self.checkpoint.restore_latest(state, data_iter)
            batch_no = int((getattr(self.checkpoint, "resumed_meta", None) or {}).get("batches", 0))
        counted = step_of(state)
        applied = counted if counted is not None else getattr(self.checkpoint, "resumed_from", None) or 0
        batch_no = batch_no or applied
        if getattr(self.checkpoint, "resumed_from", None) is not None:
            left = max(num_steps - applied, 0)
            events.append({"event": "resumed", "step": applied, "steps_left": left})
            self._say(
                f"resumed from the checkpoint at step {applied}: "
                + (f"{left} of {num_steps} steps left" if left else f"the run is already complete ({num_steps} steps)")
            )
        return _Loop(
            state=state,
            data_iter=data_iter,
            num_steps=num_steps,
            result=FitResult(state, [], events=events),
            watch=self.spikes.watch() if self.spikes is not None else None,
            bar=tqdm(total=num_steps, initial=applied, disable=not self.progress, dynamic_ncols=True, unit="step"),
            writers=([MetricsLog(self.metrics_path)] if self.metrics_path else []) + self.writers,
            applied=applied,
            batch_no=batch_no,
        )

    def _run_batch(self, loop: _Loop, eval_data: Any, eval_every: int | None) -> bool:
        """Step on the next batch (unless a rollback skips it), then flush, save and evaluate where due; False when
        the loop ends here (the data ran out, or a save answered a stop request)."""
        try:
            batch = next(loop.data_iter)
        except StopIteration:
            return False
        loop.batch_no += 1
        if loop.batch_no in loop.skip:
            return True
        upcoming = loop.applied + len(loop.pending) + 1
        if self.profile is not None:
            self.profile.before(upcoming)
        loop.state, metrics = self.step(loop.state, batch)
        loop.pending.append(_Pending(loop.batch_no, metrics, self.tokens_in_batch(batch)))
        loop.bar.update(1)
        if self.profile is not None:
            self.profile.after(upcoming, loop.state)
        save_due = self.checkpoint is not None and self.checkpoint.due(upcoming)
        eval_due = eval_data is not None and eval_every is not None and upcoming % eval_every == 0
        flush_due = len(loop.pending) >= self.log_every or upcoming == loop.num_steps or save_due or eval_due
        if flush_due and self._flush(loop):
            return True  # rolled back: the replayed batches come next
        if self.checkpoint is not None and not loop.pending and self.checkpoint.due(loop.applied):
            self.checkpoint.save(loop.applied, loop.state, loop.data_iter, {"batches": loop.batch_no})
            if self.checkpoint.stop_requested:
                loop.result.interrupted = True
                return False
        if eval_due and loop.applied == upcoming:
            self._eval_record(loop, eval_data)
        return True

    def _flush(self, loop: _Loop) -> bool:
        """Fetch the pending metrics, write their records; True when a loss spike rolled the run back."""
        if not loop.pending:
            return False
        fetched = jax.device_get([p.metrics for p in loop.pending])
        now = time.perf_counter()
        dt, loop.t_flush = (now - loop.t_flush) / len(loop.pending), now
        for i, (p, metrics) in enumerate(zip(loop.pending, fetched, strict=True)):
            metrics = to_python(metrics)
            skipped = isinstance(metrics, dict) and bool(metrics.get("skipped_nonfinite"))
            score = None
            if loop.watch is not None and not skipped and isinstance(metrics.get("loss"), float):
                score = loop.watch.check(p.batch, metrics["loss"])
            if score is not None:
                self._roll_back(loop, p.batch, metrics["loss"], score)
                return True
            self._record(loop, p, metrics, skipped, dt, last=i == len(fetched) - 1)
        loop.bar.set_postfix_str(self._postfix(loop.result.history[-1]))
        loop.pending.clear()
        loop.bar.n = loop.applied  # skipped steps were counted when dispatched
        loop.bar.refresh()
        if loop.stop is not None:
            stop, loop.stop = loop.stop, None
            raise stop
        return False

    def _record(self, loop: _Loop, p: _Pending, metrics: Any, skipped: bool, dt: float, last: bool) -> None:
        """Count one fetched step (applied, or skipped as non-finite) and write its record."""
        if skipped:
            loop.result.skipped_nonfinite += 1
            loop.nonfinite_run += 1
        else:
            loop.applied += 1
            loop.nonfinite_run = 0
            loss = metrics.get("loss") if isinstance(metrics, dict) else None
            if isinstance(loss, float) and np.isfinite(loss):
                loop.last_finite_loss = loss
        record = {
            "step": loop.applied,
            "batch": p.batch,
            **(metrics if isinstance(metrics, dict) else {"metrics": metrics}),
            "step_time_s": dt,
            "tokens_per_s": p.tokens / dt if dt else None,
            "skipped_total": loop.result.skipped_nonfinite,
        }
        failures = getattr(self.checkpoint, "failures", None)
        if isinstance(failures, int):
            record["checkpoint_failures"] = failures
        lr = self._learning_rate(loop.state, loop.applied, last=last)
        if lr is not None:
            record["lr"] = lr
        loop.result.history.append(record)
        for w in loop.writers:
            w.write(record)
        if self.max_nonfinite is not None and loop.nonfinite_run == self.max_nonfinite:
            last = "none yet" if loop.last_finite_loss is None else f"{loop.last_finite_loss:.6g}"
            loop.stop = NonFiniteError(
                f"expected training to make progress, found {loop.nonfinite_run} steps in a row whose update was not "
                f"finite (skipped, the state kept as it was), the last at batch {p.batch} (step {loop.applied}; last "
                f"finite loss: {last}); lower the learning rate, check the data for NaN or inf, or raise "
                "Trainer(max_nonfinite=)"
            )

    def _close(self, loop: _Loop) -> None:
        """Flush what is pending, close the progress bar, stop the profiler and finish the checkpoints."""
        try:
            self._flush(loop)
        finally:
            loop.bar.close()
            if self.profile is not None:
                self.profile.stop(loop.state)
            if self.checkpoint is not None:
                self.checkpoint.finish(loop.applied, loop.state, loop.data_iter, {"batches": loop.batch_no})

    def _eval_record(self, loop: _Loop, eval_data: Any) -> None:
        record = self._evaluate(loop.state, eval_data, loop.applied)
        loop.result.eval_history.append(record)
        for w in loop.writers:
            w.write(record)
        self._say(" ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("eval_") and "batches" not in k))

    def _roll_back(self, loop: _Loop, batch: int, loss: float, score: float) -> None:
        """Restore the last good checkpoint after a loss spike at ``batch``, and skip the batches around it."""
        loop.pending.clear()
        restored = self.checkpoint.roll_back(loop.state, loop.data_iter)
        if restored is None:
            raise StateError(
                f"loss spike at batch {batch} (loss {loss:.4g}, z={score:.1f}) but no good checkpoint to roll back "
                "to yet; save more often (every_steps) or raise LossSpikePolicy.min_history"
            )
        back_to = int(self.checkpoint.resumed_meta.get("batches", self.checkpoint.resumed_from))
        skipped = list(range(max(batch - self.spikes.skip_batches + 1, back_to + 1), batch + 1))
        loop.skip.update(skipped)
        loop.watch.forget_after(back_to)
        result = loop.result
        result.history = [r for r in result.history if r["batch"] <= back_to]
        event = {
            "event": "spike",
            "batch": batch,
            "loss": loss,
            "z": score,
            "rolled_back_to_step": self.checkpoint.resumed_from,
            "skipped_batches": skipped,
        }
        result.events.append(event)
        self._say(
            f"loss spike at batch {batch} (loss {loss:.4g}, z={score:.1f}): rolled back to step "
            f"{self.checkpoint.resumed_from}, skipping batches {skipped}"
        )
        loop.state = restored
        loop.rollbacks += 1
        loop.applied = step_of(restored) if step_of(restored) is not None else self.checkpoint.resumed_from
        loop.batch_no = int(self.checkpoint.resumed_meta.get("batches", loop.applied))
        loop.bar.reset(total=loop.num_steps)
        loop.bar.update(loop.applied)
        if loop.rollbacks >= self.spikes.max_rollbacks:
            raise StateError(
                f"{loop.rollbacks} loss spikes rolled the run back (LossSpikePolicy.max_rollbacks); the last at batch "
                f"{batch}, loss {loss:.4g}, z={score:.1f}: look at the data and the learning rate, or raise "
                "max_rollbacks / z"
            )
