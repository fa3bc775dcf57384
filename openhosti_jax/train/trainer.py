"""`Trainer`: the loop around an ``@spmd`` step: progress bar, JSONL metrics, checkpoints, clean Ctrl-C.

Example:
    >>> import jax, jax.numpy as jnp, optax, tempfile, os
    >>> import openhosti_jax as oh
    >>> mesh = oh.build_mesh(oh.MeshConfig(data=-1))
    >>> state, plan = oh.create_train_state(lambda r: {"w": jnp.zeros((4, 1))}, optax.sgd(0.1), mesh)
    >>> @oh.spmd(mesh=mesh, plan=plan)
    ... def step(state, batch):
    ...     loss, g = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"] - 1.0) ** 2))(state.params)
    ...     return state.apply_gradients(grads=g), {"loss": loss}
    >>> batches = ({"x": jnp.ones((8, 4))} for _ in range(3))
    >>> result = oh.Trainer(step, progress=False).fit(state, batches, num_steps=3)
    >>> int(result.state.step), len(result.history)
    (3, 3)
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from openhosti_jax.errors import StateError
from openhosti_jax.state.layout import step_of
from openhosti_jax.train.metrics import MetricsLog, to_python


@dataclasses.dataclass
class FitResult:
    """What `Trainer.fit` returns."""

    state: Any
    """The final state (after the last completed step)."""
    history: list[dict[str, Any]]
    """One metrics record per completed step."""
    interrupted: bool = False
    """True when Ctrl-C (or SIGTERM through the checkpoint manager) ended the run early."""


def _default_tokens(batch: Any) -> int:
    leaves = [x for x in jax.tree.leaves(batch) if np.ndim(x) >= 1]
    if not leaves:
        return 0
    first = leaves[0]
    return int(np.prod(np.shape(first)[:2])) * (jax.process_count() if not isinstance(first, jax.Array) else 1)


class Trainer:
    """Runs ``step(state, batch) -> (state, metrics)`` over a data iterator.

    ``checkpoint`` is an `openhosti_jax.checkpoint.CheckpointManager` (or anything with its ``maybe_save`` /
    ``restore_latest`` methods): the run resumes from its latest good step and saves on its schedule and at the end.
    """

    def __init__(
        self,
        step: Callable[[Any, Any], tuple[Any, Any]],
        *,
        metrics_path: str | os.PathLike | None = None,
        progress: bool = True,
        log_every: int = 1,
        tokens_in_batch: Callable[[Any], int] = _default_tokens,
        checkpoint: Any | None = None,
    ):
        if log_every < 1:
            raise StateError(f"log_every must be >= 1, found {log_every}")
        self.step = step
        self.metrics_path = metrics_path
        self.progress = progress and jax.process_index() == 0
        self.log_every = log_every
        self.tokens_in_batch = tokens_in_batch
        self.checkpoint = checkpoint

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

    def _postfix(self, record: dict[str, Any], dt: float, tokens: int) -> str:
        parts = []
        if isinstance(record.get("loss"), float):
            parts.append(f"loss={record['loss']:.4f}")
        if dt > 0:
            parts.append(f"{1 / dt:.2f} step/s")
            parts.append(f"{tokens / dt:,.0f} tok/s")
        parts.append(self._describe())
        return " ".join(p for p in parts if p)

    def fit(self, state: Any, data: Iterable[Any], num_steps: int) -> FitResult:
        """Train until ``num_steps`` optimizer steps are done (a resumed state continues from its count), or the data
        ends, or Ctrl-C. ``state`` is any pytree the step takes; its step count is its ``step`` field or optax's
        ``count`` (`openhosti_jax.state.layout.step_of`), else the resumed checkpoint's step."""
        data_iter: Iterator[Any] = iter(data)
        if self.checkpoint is not None:
            state = self.checkpoint.restore_latest(state, data_iter)
        counted = step_of(state)
        start = counted if counted is not None else getattr(self.checkpoint, "resumed_from", None) or 0
        done = start
        history: list[dict[str, Any]] = []
        interrupted = False
        bar = tqdm(total=num_steps, initial=start, disable=not self.progress, dynamic_ncols=True, unit="step")
        log = MetricsLog(self.metrics_path)
        t_prev = time.perf_counter()
        try:
            for i in range(start, num_steps):
                try:
                    batch = next(data_iter)
                except StopIteration:
                    break
                state, metrics = self.step(state, batch)
                done = i + 1
                metrics = to_python(jax.device_get(metrics))
                now = time.perf_counter()
                dt, t_prev = now - t_prev, now
                tokens = self.tokens_in_batch(batch)
                record = {
                    "step": i + 1,
                    **metrics,
                    "step_time_s": dt,
                    "tokens_per_s": tokens / dt if dt else None,
                }
                history.append(record)
                if (i + 1) % self.log_every == 0 or i + 1 == num_steps:
                    log.write(record)
                    bar.set_postfix_str(self._postfix(record, dt, tokens))
                bar.update(1)
                if self.checkpoint is not None:
                    stop = self.checkpoint.maybe_save(done, state, data_iter)
                    if stop:
                        interrupted = True
                        break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
            log.close()
            if self.checkpoint is not None:
                self.checkpoint.finish(done, state, data_iter)
        return FitResult(state, history, interrupted)
