"""The small core that jits a train step under a plan, and reads what the compiled step needs per device.

`jit_step` places the state and batch by the plan, donates the state, and makes the plan's gradient shardings and
microbatch count active while the step is traced (so `TrainState.apply_gradients` reduce-scatters under ZeRO-2/3
and `make_train_step` accumulates). ``@spmd``, the planner's AOT verification and its measured refinement all
compile through it. Per-device bytes = arguments + outputs + temporaries - aliased (donated) bytes (on TPU the
compiler's peak); a backend that reports all zeros gives ``None`` (unknown), never 0.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.state.jit import memory_bytes
    >>> c = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((1024,), jnp.float32)).compile()
    >>> memory_bytes(c) >= 4096
    True
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import ConfigError, StateError, StepOutputError
from openhosti_jax.policies.fp8 import device_fp8_problem
from openhosti_jax.policies.precision import precision
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.state.context import (
    active_activation_sharding,
    active_gradient_shardings,
    active_microbatches,
    active_policies,
    guarding_updates,
)
from openhosti_jax.state.contracts import StepFn
from openhosti_jax.state.guard import after_guarded_update
from openhosti_jax.state.guard import skip_nonfinite as select_finite
from openhosti_jax.state.init import state_specs
from openhosti_jax.state.layout import StateLayout, find_layout
from openhosti_jax.state.train_state import TrainState


def jit_step(
    fn: StepFn,
    plan: ShardingPlan,
    mesh: Mesh,
    state: Any,
    batch: Any,
    *,
    donate: bool = True,
    num_microbatches: int | None = None,
    layout: StateLayout | None = None,
    skip_nonfinite: bool = True,
    batch_shardings: Any = None,
    free_outputs: bool = False,
    compiler_options: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """(``fn`` jitted with the plan's in/out shardings for arguments shaped like ``state`` and ``batch``, the
    state's shardings). Metrics come back replicated. ``num_microbatches`` defaults to the plan's; ``layout``
    (default: found) says where the state keeps its parameters and optimizer state. ``batch_shardings`` (default:
    leading dims over the plan's batch spec) place the batch; ``free_outputs`` lets the step's second output be any
    pytree (not only scalar metrics), placed where the compiler puts it. ``compiler_options``: XLA options for the
    step's compile (`jax.jit`'s; `openhosti_jax.policies.compiler.step_settings` gives a GPU's). ``skip_nonfinite``
    keeps the old state when the step's gradients (or loss) are not finite (`openhosti_jax.state.guard`: inside
    `TrainState.apply_gradients` when the state is one, else by a select after the step), except under a
    loss-scaling precision, whose optimizer skips those steps itself."""
    k = num_microbatches or plan.num_microbatches
    if precision(plan.precision).fp8_matmuls and (problem := device_fp8_problem(mesh.devices.flat[0])):
        raise ConfigError(problem)
    layout = layout if layout is not None else find_layout(state)
    guarded = skip_nonfinite and not precision(plan.precision).loss_scaling
    state_sh = plan.shardings(mesh, state_specs(plan, state, layout))
    grad_sh = plan.shardings(mesh, plan.grad_specs)
    batch_sh = plan.batch_shardings(mesh, batch) if batch_shardings is None else batch_shardings

    def traced(s: Any, b: Any) -> tuple[Any, Any]:
        with (
            active_gradient_shardings(grad_sh),
            active_microbatches(k) as count,
            active_policies(plan.remat, plan.precision) as policies,
            guarding_updates() if guarded else contextlib.nullcontext() as update_guard,
            activation_context(plan, mesh),
        ):
            out = fn(s, b)
        if precision(plan.precision).loss_scaling and not policies.loss_scaled:
            raise StateError(
                f"the plan's precision {plan.precision!r} scales the loss dynamically, but the step never multiplied "
                "its loss by the scale, so its gradients would be divided by it; build the step with "
                "openhosti_jax.make_train_step(loss_sum_fn), or multiply the loss by "
                "openhosti_jax.policies.optimizers.scale_loss(loss, state.opt_state) and call "
                "openhosti_jax.state.context.mark_loss_scaled()"
            )
        if (plan.remat, plan.precision) != ("none", "fp32") and not policies.applied:
            raise StateError(
                f"the plan runs remat={plan.remat!r} precision={plan.precision!r}, which apply where the step calls "
                "the model through the apply function the library built (state.apply_fn from create_train_state, "
                "or openhosti_jax.state.model.model_parts), but this step never called one; call state.apply_fn in "
                "the step, or use a plan with remat='none' and precision='fp32'"
            )
        if k > 1 and not count.read:
            raise StateError(
                f"the step runs {k} microbatches but never asks for them, so it would train on the whole batch at "
                "once while the plan says otherwise; build it with openhosti_jax.make_train_step(loss_sum_fn), or read "
                "openhosti_jax.state.context.current_microbatches() in it, or drop microbatch="
            )
        check_step_output(s, out, metrics=not free_outputs)
        if not guarded:
            return out
        if update_guard.used and isinstance(out[0], TrainState) and isinstance(s, TrainState):
            return after_guarded_update(s, *out)
        return select_finite(s, *out, params=layout.params)

    jitted = jax.jit(
        traced,
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, None if free_outputs else NamedSharding(mesh, P())),
        donate_argnums=(0,) if donate else (),
        compiler_options=compiler_options or None,
    )
    return jitted, state_sh


def activation_context(plan: ShardingPlan, mesh: Mesh) -> contextlib.AbstractContextManager[None]:
    """The context in which the model's repeated blocks take and return activations placed as ``plan``'s batch
    spec says (batch over its batch axes, the sequence over ``context`` where it splits it), the embedding's output
    and the logits too (`openhosti_jax.state.context.active_activation_sharding`); where ``plan`` is sequence
    parallel over a ``tensor`` axis of ``mesh``, split along the sequence over it as well (and run their
    projections as collective matmuls where the plan asks). Nothing on a single device.

    Where the plan also splits the batch's sequence over ``context`` (its batch spec has a second entry), sequence
    parallelism only with collective matmuls, which split the sequence over ``(context, tensor)``: with XLA's
    partitioner computing the projections instead, it miscompiles (jax 0.10.2) a weight gradient between the two
    splits: ``einsum("bsa,bsd->ad")`` of operands placed ``(fsdp, context, tensor)`` and ``(fsdp, context+tensor,
    -)`` into ``(fsdp, -)`` comes out wrong. A collective matmul computes it per device inside `jax.shard_map`.
    """
    spec = tuple(plan.batch_spec)
    sizes = dict(mesh.shape)
    if mesh.size <= 1:
        return contextlib.nullcontext()
    batch_axes = spec[0] if spec else None
    seq = spec[1] if len(spec) > 1 else None
    tensor = "tensor" if sizes.get("tensor", 1) > 1 else None
    if plan.sequence_parallel and tensor:
        if seq is None:
            return active_activation_sharding(mesh, batch_axes, "tensor", plan.collective_matmul, tensor)
        if plan.collective_matmul:
            return active_activation_sharding(mesh, batch_axes, (seq, "tensor"), True, tensor)
    return active_activation_sharding(mesh, batch_axes, seq, False, tensor)


def jit_eval(
    fn: Any, plan: ShardingPlan, mesh: Mesh, state: Any, batch: Any, *, layout: StateLayout | None = None
) -> Any:
    """``fn(state, batch) -> metrics`` jitted under the plan like `jit_step` (same state and batch shardings, the
    plan's precision and remat active), without donation: the state stays usable. Metrics come back replicated."""
    state_sh = plan.shardings(mesh, state_specs(plan, state, layout))

    def traced(s: Any, b: Any) -> Any:
        with active_policies(plan.remat, plan.precision), activation_context(plan, mesh):
            return fn(s, b)

    return jax.jit(
        traced,
        in_shardings=(state_sh, plan.batch_shardings(mesh, batch)),
        out_shardings=NamedSharding(mesh, P()),
    )


def check_step_output(state: Any, out: Any, metrics: bool = True) -> None:
    """Raise `StateError` listing every way ``out`` is not ``(new state like state, metrics of scalars)``: the
    state's structure, each leaf's shape and dtype, and (``metrics``) each metric's rank; `StepOutputError` when
    ``out`` is not a pair at all."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise StepOutputError(
            f"a train step must return (new_state, metrics), found {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, tuple | list) else "")
            + "; return the updated state and a dict of scalar metrics"
        )
    new, values = out
    if jax.tree.structure(new) != jax.tree.structure(state):
        raise StateError(
            f"the step returned a state of another structure than it took:\n  took     {jax.tree.structure(state)}"
            f"\n  returned {jax.tree.structure(new)}\nreturn the same pytree (e.g. state.replace(...)), with the "
            "same fields and keys"
        )
    problems = [
        f"state{jax.tree_util.keystr(p)}: took {a.shape} {a.dtype}, returned {b.shape} {b.dtype}"
        for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(new), strict=True)
        if (np.shape(a), jnp.result_type(a)) != (np.shape(b), jnp.result_type(b))
    ]
    if problems:
        raise StateError(
            "the step changed the shape or dtype of state leaves (a jitted step keeps them fixed):\n  "
            + "\n  ".join(problems)
            + "\ncast or reshape back before returning, e.g. new.astype(old.dtype)"
        )
    bad = [
        f"metrics{jax.tree_util.keystr(p)}: shape {np.shape(m)}"
        for p, m in jax.tree_util.tree_flatten_with_path(values)[0]
        if metrics and np.ndim(m)
    ]
    if bad:
        raise StateError(
            "expected every metric to be a scalar, found " + ", ".join(bad) + "; reduce it (jnp.mean, jnp.sum) "
            "or return it from the state instead"
        )


def memory_stats(compiled: jax.stages.Compiled) -> dict[str, int] | None:
    """``memory_analysis()`` fields per device (argument, output, temp, alias, peak); ``None`` when unreported.

    All-zero fields (some GPU/TPU builds) count as unreported.
    """
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    out = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
        "peak": int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
    }
    return out if any(out.values()) else None


def footprint_bytes(stats: dict[str, int]) -> int:
    """The buffer assignment's footprint: arguments + temporaries + outputs not aliased to donated arguments."""
    return stats["argument"] + stats["temp"] + stats["output"] - stats["alias"]


def compiled_platform(compiled: jax.stages.Compiled) -> str | None:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``) a compiled program's inputs live on (None without inputs)."""
    for sharding in jax.tree.leaves(compiled.input_shardings):
        devices = getattr(sharding, "device_set", None)
        if devices:
            return next(iter(devices)).platform
    return None


def memory_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Per-device bytes of a compiled program (None when the backend does not report them): on TPU the compiler's
    own peak (``peak_memory_in_bytes``, what XLA:TPU holds a program to against the chip's HBM: its
    ``temp_size_in_bytes`` counts buffers that are never live together), elsewhere the buffer assignment's
    footprint (`footprint_bytes`)."""
    stats = memory_stats(compiled)
    if stats is None:
        return None
    total = stats["peak"] if stats["peak"] and compiled_platform(compiled) == "tpu" else footprint_bytes(stats)
    return total if total > 0 else None
