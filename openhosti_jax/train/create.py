"""`create_train_state`: a sharded `TrainState` from a model and an optimizer, by a named strategy, a ZeRO stage,
a `ShardingPlan` or ``"auto"`` (the planner chooses on the given mesh); it returns a `CreatedState`, which unpacks as
``(state, plan)`` and carries the planner's ``report``.

Linen: ``init_fn(rng) -> params`` (with ``apply_fn=model.apply``-style). nnx: ``init_fn(rng) -> nnx.Module``; the
module is split into its graph (kept in ``apply_fn``), its `nnx.Param` leaves (``params``) and the rest
(``model_state``). The parameters are initialised straight into their shards.

Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> from openhosti_jax import build_mesh, MeshConfig, create_train_state
    >>> model = nn.Dense(64)
    >>> mesh = build_mesh(MeshConfig(data=-1))
    >>> created = create_train_state(lambda r: model.init(r, jnp.ones((1, 64)))["params"],
    ...                              optax.adam(1e-3), mesh, apply_fn=model.apply)
    >>> state, plan = created  # the pair; the planner's reasons are created.report
    >>> int(state.step), plan is created.plan, created.report.plan is plan
    (0, True, True)
    >>> state, plan = create_train_state(lambda r: {"w": jnp.zeros((64, 64))}, optax.sgd(0.1), mesh, plan="fsdp")
    >>> plan.zero_stage
    3
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from openhosti_jax.errors import StateError
from openhosti_jax.mesh.build import mesh_sizes
from openhosti_jax.pipeline.state import PipelineState
from openhosti_jax.planner.search import plan_on_mesh
from openhosti_jax.policies.optimizers import optimizer_for
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import PlanReport
from openhosti_jax.sharding.zero import Optimizer
from openhosti_jax.state.contracts import ApplyFn
from openhosti_jax.state.init import init_state
from openhosti_jax.state.model import model_parts
from openhosti_jax.state.train_state import TrainState
from openhosti_jax.train.pipelined import create_pipeline_state

PlanChoice = str | int | ShardingPlan
"""What ``plan=`` takes: ``"fsdp"`` (ZeRO-3), ``"dp"`` (ZeRO-0), ``"zero1"``/``"zero2"``, an int ZeRO stage,
``"auto"`` (the planner chooses), or a `ShardingPlan`."""


class CreatedState(tuple[TrainState | PipelineState, ShardingPlan]):
    """What `create_train_state` returns: a pair ``(state, plan)`` (so ``state, plan = create_train_state(...)``
    unpacks it, as `os.stat_result` unpacks), with the parts named and the planner's reasons kept.

    ``state``: the sharded `TrainState`, or a stage-local `openhosti_jax.pipeline.PipelineState` when the plan
    pipelines. ``plan``: the `ShardingPlan` it was laid out by. ``report``: the `PlanReport` saying why that plan
    (the planner's ranked candidates for ``"auto"``, the ZeRO stage a strategy name maps to); None where the caller
    gave the `ShardingPlan` itself.
    """

    report: PlanReport | None

    def __new__(cls, state: TrainState | PipelineState, plan: ShardingPlan, report: PlanReport | None = None):
        created = super().__new__(cls, (state, plan))
        created.report = report
        return created

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self[0], self[1], self.report)

    @property
    def state(self) -> TrainState | PipelineState:
        """The sharded state (first of the pair)."""
        return self[0]

    @property
    def plan(self) -> ShardingPlan:
        """The plan the state is laid out by (second of the pair)."""
        return self[1]

    def __repr__(self) -> str:
        report = "PlanReport" if self.report is not None else "None"
        return f"CreatedState(state={type(self[0]).__name__}, plan=ShardingPlan, report={report})"


_NAMED = {"dp": 0, "ddp": 0, "zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}


def resolve_plan(
    strategy: PlanChoice, abstract_params: Any, tx: Optimizer, mesh: Mesh, **plan_kw: Any
) -> tuple[ShardingPlan, PlanReport]:
    """(plan, report) for a strategy name, a ZeRO stage or a plan on ``mesh``; ``"auto"`` runs the planner
    (`openhosti_jax.planner.plan_on_mesh`, which takes ``plan_kw``). Internal: the library's doors (``@spmd``,
    `create_train_state`, the demo job) share it; users call `openhosti_jax.choose_plan` or `create_train_state`."""
    if isinstance(strategy, ShardingPlan):
        strategy.check_mesh(mesh)
        return strategy, PlanReport(strategy, abstract_params)
    if strategy == "auto":
        return plan_on_mesh(abstract_params, tx, mesh, **plan_kw)
    stage = _NAMED.get(strategy, strategy) if isinstance(strategy, str) else strategy
    if stage not in (0, 1, 2, 3):
        raise StateError(
            f"unknown sharding strategy {strategy!r}; expected 'dp', 'zero1', 'zero2', 'fsdp', 'auto', "
            "0-3 or a ShardingPlan"
        )
    tx = optimizer_for(tx, plan_kw.get("precision", "fp32")) if isinstance(tx, optax.GradientTransformation) else tx
    plan = ShardingPlan.from_zero(abstract_params, tx, mesh_sizes(mesh), stage, **plan_kw)
    return plan, PlanReport(plan, abstract_params, notes=(f"strategy {strategy!r}: ZeRO stage {stage}",))


def create_train_state(
    init_fn: Callable[[jax.Array], Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    plan: PlanChoice = "auto",
    apply_fn: ApplyFn | None = None,
    seed: int | jax.Array = 0,
    sample_batch: Any = None,
    model_kwargs: Mapping[str, Any] | None = None,
    **plan_kw: Any,
) -> CreatedState:
    """Initialise parameters and optimizer state directly into their shards; return a `CreatedState`, which
    unpacks as ``state, plan = create_train_state(...)`` and names ``.state``, ``.plan`` and ``.report``.

    ``plan`` defaults to ``"auto"``: the planner chooses the ZeRO stage on ``mesh`` from the abstract parameters
    (and the forward on ``sample_batch``, with ``apply_fn``); a strategy name or a plan fixes it.
    ``seed`` seeds both the init key and the state's ``rng`` (used for dropout etc.). ``.report`` is the
    planner's `PlanReport` (why this plan) where it planned or mapped a strategy name, None for a given
    `ShardingPlan`. A pipelined plan (``pipeline_stages`` > 1) gives a stage-local
    `openhosti_jax.pipeline.PipelineState`, cut from the model's forward pass on ``sample_batch`` called with
    ``model_kwargs`` (``{"with_aux": True}``: an MoE model's outputs, which `openhosti_jax.pipeline_step`'s loss
    receives, are ``(logits, aux)``); train it with `openhosti_jax.pipeline_step`. An unpipelined state's step calls
    the model itself: ``model_kwargs`` is then a `StateError`.
    """
    if isinstance(plan, ShardingPlan) and plan.pipeline_stages > 1:
        if sample_batch is None:
            raise StateError(
                f"the plan pipelines over {plan.pipeline_stages} stages, which cuts the model's forward pass where "
                "its blocks are called: pass sample_batch= (the inputs, or (inputs, targets)) to trace it"
            )
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        state = create_pipeline_state(
            init_fn, tx, mesh, plan, sample_batch, key=key, apply_fn=apply_fn, model_kwargs=model_kwargs
        )
        return CreatedState(state, plan)
    if model_kwargs is not None:
        raise StateError(
            f"model_kwargs={dict(model_kwargs)!r} are for a pipelined plan, whose step calls the model; expected "
            "none for this unpipelined plan, found some: pass them in your step's own call of state.apply_fn"
        )
    parts = model_parts(init_fn, apply_fn=apply_fn, mesh=mesh)
    the_plan, report = resolve_plan(plan, parts.params, tx, mesh, **plan_kw)
    the_plan.validate(parts.params)
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    return CreatedState(
        init_state(parts, tx, mesh, the_plan, key), the_plan, None if isinstance(plan, ShardingPlan) else report
    )
