"""``Strategy(plan="auto")``: the library's planner chooses the mesh and ZeRO stage for the variables a Keras model
made inside the strategy's scope.

The planner's cost model (`openhosti_jax.planner.search`) scores every data x fsdp mesh of the devices at ZeRO
stage 0 (replicated, DDP) or 3 (each variable split, FSDP), with the optimizer's state as Keras keeps it (its slot
count, measured on a copy of the model's optimizer), within the memory budget (given, else the devices' limit or
their spec sheet), and ranks them as `openhosti_jax.planner.choose_plan` does. Keras creates an optimizer slot with
its variable's layout, so stages 1 and 2 (state split, parameters not) are not candidates; nor are tensor or
pipeline axes: a Keras model has no tensor-parallel names or stages for them. Activations are not known when the
scope closes (the batch comes later), so the choice rests on state memory and gradient traffic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PlanningError
from openhosti_jax.mesh.config import AXES
from openhosti_jax.planner import device_profile as resolve_profile
from openhosti_jax.planner.search import (
    enumerate_candidates,
    gradient_bytes,
    memory_budget_for,
    rank,
    report_for,
    search,
    why,
)
from openhosti_jax.planner.workload import measure
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import PlanReport
from openhosti_jax.sharding.zero import ZERO_AXES, zero_specs

DEFAULT_SLOTS = 2
"""Optimizer slots per variable assumed when no Keras optimizer was made in the scope (Adam's two moments)."""


def slot_count(keras: Any, optimizer: Any) -> int:
    """How many variable-sized slots ``optimizer`` keeps per trained variable: a copy of it is built, with no
    distribution set, on one variable of 64 elements."""
    active = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        probe = type(optimizer).from_config(optimizer.get_config())
        variable = keras.Variable(jnp.zeros((64,), "float32"), name="probe")
        probe.build([variable])
        return round(sum(math.prod(v.shape) for v in probe.variables if len(v.shape)) / 64)
    finally:
        keras.distribution.set_distribution(active)


def stand_in_optimizer(slots: int) -> optax.GradientTransformation:
    """An optax transformation whose state is ``slots`` copies of the parameters: what the planner prices."""
    return optax.GradientTransformation(
        lambda params: tuple(jax.tree.map(jnp.zeros_like, params) for _ in range(slots)),
        lambda updates, state, params=None: (updates, state),
    )


def _sizes(shape: Mapping[str, int]) -> dict[str, int]:
    """Every mesh axis's size in ``shape`` (1 where it names none), so shapes listing different axes compare."""
    return {a: int(shape.get(a, 1)) for a in AXES}


def plan_variables(
    params: Mapping[str, jax.ShapeDtypeStruct],
    devices: Sequence[jax.Device],
    *,
    slots: int,
    global_batch: int,
    memory_budget: int | None = None,
    device_profile: Any = None,
    mesh_shape: Mapping[str, int] | None = None,
) -> tuple[ShardingPlan, PlanReport]:
    """(plan, report) for training ``params`` (Keras paths -> shapes) on ``devices``: a data x fsdp mesh (only
    ``mesh_shape`` when given) at ZeRO stage 0 or 3, the planner's fastest that fits the memory budget."""
    if not params:
        raise PlanningError("plan='auto' found no trainable variables to plan; build the model inside the scope")
    tx = stand_in_optimizer(slots)
    work = measure(dict(params), None, None, jax.ShapeDtypeStruct((global_batch,), jnp.float32))
    candidates = [
        c
        for c in enumerate_candidates(len(devices), tensor=False)
        if c.zero_stage in (0, 3) and (mesh_shape is None or _sizes(c.mesh_shape) == _sizes(mesh_shape))
    ]
    profile = resolve_profile(list(devices), device_profile, max_bytes=gradient_bytes(work))
    budget, source = memory_budget_for(list(devices), profile, memory_budget)
    scored = search(work, tx, candidates, profile, memory_budget=budget, remats=("none",))
    ranked = rank(scored, budget)
    notes = [
        *why(ranked, scored, budget),
        f"device profile: {profile.name}; memory budget: {source}",
        f"keras: {len(params)} trained variables, {slots} optimizer slot(s) each; ZeRO 0 or 3 on data x fsdp "
        "meshes (a slot takes its variable's layout); activations unknown when the scope closes",
    ]
    return ranked[0].plan, report_for(ranked[0], ranked, notes, work)


def spec_axes(spec: P, ndim: int) -> tuple[str | tuple[str, ...] | None, ...]:
    """A PartitionSpec as a Keras layout's axes, one per dim (axes of size 1 are kept: they split nothing)."""
    axes = tuple(None if e is None else (e if isinstance(e, str) else tuple(e)) for e in spec)
    return axes + (None,) * (ndim - len(axes))


def layout_for(plan: ShardingPlan, shape: tuple[int, ...], dtype: Any) -> tuple[str | tuple[str, ...] | None, ...]:
    """The axes ``plan``'s ZeRO rule gives a variable it was not made for (created after planning)."""
    axes = ("fsdp",) if plan.mesh_shape.get("data", 1) > 1 else ZERO_AXES  # as the search's candidates shard
    leaf = {"v": jax.ShapeDtypeStruct(shape, dtype)}
    specs, _, _ = zero_specs(leaf, None, plan.mesh_shape, plan.zero_stage, axes=axes)
    return spec_axes(specs["v"], len(shape))


__all__ = ["DEFAULT_SLOTS", "layout_for", "plan_variables", "slot_count", "spec_axes", "stand_in_optimizer"]
