"""Measured refinement: compile the top predicted candidates, time real steps of each, keep the fastest.

The fastest replaces the predicted winner only by a lead beyond `MEASURED_TIE` (`measured_order`).

The cost model ranks every candidate in milliseconds of Python; `time_plans` then spends compiles on the few
best (Alpa / autotuning style). State is built directly in its shards (parameters zero-filled: step time does
not depend on their values), the batch is the sample batch (zeros when it is abstract). Candidates are timed in
alternating rounds so machine noise spreads over all of them; the median step time of each is returned.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from openhosti_jax.planner import choose_plan
    >>> _, report = choose_plan(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), optax.sgd(0.1),
    ...                         jax.ShapeDtypeStruct((8, 64), jnp.float32), jax.devices()[:1], refine=1)
    >>> any(n.startswith("refined") for n in report.notes)
    True
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from openhosti_jax.mesh.build import build_mesh
from openhosti_jax.mesh.config import MeshConfig
from openhosti_jax.planner.workload import Workload
from openhosti_jax.sharding.batch import place_batch
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.state.contracts import StepFn
from openhosti_jax.state.init import init_state
from openhosti_jax.state.jit import jit_step
from openhosti_jax.state.model import ModelParts
from openhosti_jax.state.train_state import TrainState

MEASURED_TIE = 0.02
"""A measured lead under this fraction is noise: identical plans time a few percent apart on a busy host."""


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def sharded_state(plan: ShardingPlan, work: Workload, tx: optax.GradientTransformation, mesh: Any) -> TrainState:
    """A zero-initialised `TrainState` for ``work`` placed in ``plan``'s shardings on ``mesh``."""
    parts = ModelParts(lambda _: (_zeros(work.params), work.model_state), work.params, None, work.apply_fn)
    return init_state(parts, tx, mesh, plan)


def time_plans(
    plans: Sequence[ShardingPlan],
    work: Workload,
    tx: optax.GradientTransformation,
    step_fn: StepFn,
    devices: Sequence[jax.Device],
    sample_batch: Any,
    *,
    steps: int = 3,
    rounds: int = 2,
) -> list[float]:
    """Median measured seconds per step of each plan (compiled once each, one warm-up step)."""
    batch = jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, sample_batch
    )
    runs = []
    for p in plans:
        mesh = build_mesh(MeshConfig.from_sizes(dict(p.mesh_shape)), devices)
        state, placed = sharded_state(p, work, tx, mesh), place_batch(batch, mesh, p.batch_spec)
        fn, _ = jit_step(step_fn, p, mesh, state, placed)

        def step(s: TrainState, fn: Any = fn, mesh: Any = mesh, b: Any = placed) -> tuple[TrainState, Any]:
            with jax.set_mesh(mesh):
                return fn(s, b)

        state, metrics = step(state)
        jax.block_until_ready(metrics)
        runs.append([step, state, []])
    for _ in range(rounds):
        for run in runs:
            step, state, times = run
            for _ in range(steps):
                t = time.perf_counter()
                state, metrics = step(state)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t)
            run[1] = state
    return [float(np.median(r[2])) for r in runs]


def measured_order(seconds: Sequence[float], tie: float) -> list[int]:
    """Indices of candidates given in predicted order (``seconds``: their measured times), fastest first, except
    that the predicted winner (index 0) stays first unless another beats it by more than the fraction ``tie``:
    a smaller measured lead is noise (identical plans time a few percent apart on a busy host).

    Example:
        >>> measured_order([10.0, 9.9, 11.0], 0.02), measured_order([10.0, 9.0, 11.0], 0.02)
        ([0, 1, 2], [1, 0, 2])
    """
    order = sorted(range(len(seconds)), key=lambda i: seconds[i])
    if seconds[order[0]] >= seconds[0] * (1 - tie):
        order.sort(key=lambda i: i != 0)  # stable: the rest stay by time
    return order
