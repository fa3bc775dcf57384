"""Create a sharded `TrainState` without ever materialising the parameters on one device.

The init function runs under `jax.jit` with ``out_shardings`` from the plan, so every device computes only its own
shard. Linen: ``init_fn(rng) -> params``. nnx: ``init_fn(rng) -> nnx.Module``; the module is split into its
graph (kept in ``apply_fn``), its `nnx.Param` leaves (``params``) and the rest (``model_state``).

Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> from openhosti_jax import build_mesh, MeshConfig
    >>> from openhosti_jax.state import create_train_state
    >>> model = nn.Dense(64)
    >>> mesh = build_mesh(MeshConfig(data=-1))
    >>> state, plan = create_train_state(lambda r: model.init(r, jnp.ones((1, 64)))["params"],
    ...                                  optax.adam(1e-3), mesh, apply_fn=model.apply)
    >>> int(state.step)
    0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from openhosti_jax.errors import StateError
from openhosti_jax.mesh.build import mesh_sizes
from openhosti_jax.planner.plan import ShardingPlan
from openhosti_jax.state.train_state import TrainState

Strategy = str | int | ShardingPlan
"""``"fsdp"`` (ZeRO-3), ``"dp"`` (ZeRO-0), ``"zero1"``/``"zero2"``, an int ZeRO stage, ``"auto"``, or a plan."""

_NAMED = {"dp": 0, "ddp": 0, "zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}


def _split_nnx(module: nnx.Module) -> tuple[Any, Any, Any]:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return graphdef, params, rest


def nnx_apply_fn(graphdef: Any) -> Callable[..., Any]:
    """``apply_fn(params, *args, model_state=None, **kw)`` calling the merged nnx module."""

    def apply(params: Any, *args: Any, model_state: Any = None, **kwargs: Any) -> Any:
        module = nnx.merge(graphdef, params, model_state) if model_state is not None else nnx.merge(graphdef, params)
        return module(*args, **kwargs)

    return apply


def resolve_plan(
    strategy: Strategy, abstract_params: Any, tx: optax.GradientTransformation, mesh: Mesh, **plan_kw: Any
) -> ShardingPlan:
    """A `ShardingPlan` for the given strategy name, ZeRO stage or plan on ``mesh``."""
    if isinstance(strategy, ShardingPlan):
        strategy.check_mesh(mesh)
        return strategy
    if strategy == "auto":
        from openhosti_jax.planner.search import plan_on_mesh

        return plan_on_mesh(abstract_params, tx, mesh, **plan_kw)
    stage = _NAMED.get(strategy, strategy) if isinstance(strategy, str) else strategy
    if stage not in (0, 1, 2, 3):
        raise StateError(
            f"unknown sharding strategy {strategy!r}; expected 'dp', 'zero1', 'zero2', 'fsdp', 'auto', "
            "0-3 or a ShardingPlan"
        )
    return ShardingPlan.from_zero(abstract_params, tx, mesh_sizes(mesh), stage, **plan_kw)


def create_train_state(
    init_fn: Callable[[jax.Array], Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    plan: Strategy = "fsdp",
    apply_fn: Callable[..., Any] | None = None,
    seed: int | jax.Array = 0,
    **plan_kw: Any,
) -> tuple[TrainState, ShardingPlan]:
    """Initialise parameters and optimizer state directly into their shards; return (state, plan).

    ``seed`` seeds both the init key and the state's ``rng`` (used for dropout etc.).
    """
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    init_key, state_key = jax.random.split(key)
    try:
        with jax.set_mesh(mesh):  # nnx sharding annotations need a mesh even when only shapes are traced
            abstract = jax.eval_shape(init_fn, init_key)
    except Exception as e:  # noqa: BLE001 - the user's init failed on abstract inputs: say so
        raise StateError(f"init_fn(rng) failed under jax.eval_shape: {e}") from e
    is_nnx = isinstance(abstract, nnx.Module)
    if is_nnx:
        graphdef, abstract_params, _ = _split_nnx(abstract)
        apply_fn = apply_fn or nnx_apply_fn(graphdef)
    else:
        abstract_params = abstract
        if not jax.tree.leaves(abstract_params):
            raise StateError("init_fn(rng) returned no array leaves; expected a params pytree or an nnx.Module")
    the_plan = resolve_plan(plan, abstract_params, tx, mesh, **plan_kw)
    the_plan.validate(abstract_params)

    def build(k_init: jax.Array, k_state: jax.Array) -> TrainState:
        out = init_fn(k_init)
        params, rest = _split_nnx(out)[1:] if is_nnx else (out, None)
        return TrainState.create(apply_fn=apply_fn, params=params, tx=tx, rng=k_state, model_state=rest)

    with jax.set_mesh(mesh):
        abstract_state = jax.eval_shape(build, init_key, state_key)
    shardings = the_plan.shardings(mesh, the_plan.state_specs(abstract_state))
    with jax.set_mesh(mesh):
        state = jax.jit(build, out_shardings=shardings)(init_key, state_key)
    return state, the_plan


def abstract_train_state(state: TrainState) -> TrainState:
    """The state as `jax.ShapeDtypeStruct` leaves carrying their shardings (a restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
