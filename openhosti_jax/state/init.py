"""Build a `TrainState` straight into its shards, and the specs of a state under a plan.

The init runs under `jax.jit` with ``out_shardings`` from the plan, so every device computes only its own shard and
the parameters are never materialised on one device.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from openhosti_jax import build_mesh, MeshConfig
    >>> from openhosti_jax.sharding import ShardingPlan
    >>> from openhosti_jax.state.init import init_state
    >>> from openhosti_jax.state.model import model_parts
    >>> mesh = build_mesh(MeshConfig(data=1, fsdp=-1))
    >>> parts = model_parts(lambda r: {"w": jnp.zeros((64, 8))})
    >>> plan = ShardingPlan.from_zero(parts.params, optax.sgd(0.1), {"fsdp": 8}, 3, min_elements=1)
    >>> state = init_state(parts, optax.sgd(0.1), mesh, plan)
    >>> state.params["w"].sharding.spec
    P('fsdp', None)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, SingleDeviceSharding

from openhosti_jax.policies.optimizers import optimizer_for
from openhosti_jax.policies.precision import precision
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.state.layout import StateLayout, find_layout
from openhosti_jax.state.model import ModelParts
from openhosti_jax.state.train_state import TrainState


def state_specs(plan: ShardingPlan, state: Any, layout: StateLayout | None = None) -> Any:
    """Specs for a whole state pytree (`find_layout` locates its parameters and optimizer state): those as
    planned, leaves mirroring the parameters like them, every other leaf replicated."""
    return (layout or find_layout(state)).specs(state, plan.param_specs, plan.opt_specs)


def abstract_train_state(state: Any) -> Any:
    """The state as `jax.ShapeDtypeStruct` leaves carrying their shardings (a restore or compile target); a leaf
    that is not yet a ``jax.Array`` (flax's ``step=0``) goes to this process's first device, and ``@spmd`` places it
    by the plan on the next step."""
    here = SingleDeviceSharding(jax.local_devices()[0])

    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=here)

    return jax.tree.map(leaf, state)


def init_state(
    parts: ModelParts,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    plan: ShardingPlan,
    key: jax.Array | None = None,
) -> TrainState:
    """The `TrainState` of ``parts`` and ``tx`` computed in ``plan``'s shardings on ``mesh``.

    ``key`` (default ``jax.random.key(0)``) is split into the init key and the state's ``rng``. The parameters are
    stored in the plan's precision (``bf16_params``: bfloat16, with ``tx`` keeping an fp32 master copy;
    ``fp16``: ``tx`` scales the loss, `openhosti_jax.policies.optimizers.optimizer_for`).
    """
    init_key, state_key = jax.random.split(jax.random.key(0) if key is None else key)
    tx = optimizer_for(tx, plan.precision)
    mp = precision(plan.precision)

    def build(k_init: jax.Array, k_state: jax.Array) -> TrainState:
        params, rest = parts.init(k_init)
        stored = mp.cast_to_param(params)
        state = TrainState.create(apply_fn=parts.apply_fn, params=stored, tx=tx, rng=k_state, model_state=rest)
        return state.replace(opt_state=tx.init(params)) if mp.master_weights else state  # an exact fp32 master

    with jax.set_mesh(mesh):
        shapes = jax.eval_shape(build, init_key, state_key)
        shardings = plan.shardings(mesh, state_specs(plan, shapes))
        return jax.jit(build, out_shardings=shardings)(init_key, state_key)
