"""``@spmd``: shard a user's ``train_step(state, batch) -> (state, metrics)`` over a mesh by a plan.

The state is any pytree: the library's `TrainState`, a flax ``TrainState`` subclass, a plain ``(params,
opt_state)``, an ``nnx.split`` state. Its parameters and optimizer state are found by
`openhosti_jax.state.layout.find_layout` (``params=`` / ``opt_state=`` name them for unusual layouts). The decorator
places the batch over the data-parallel axes (`openhosti_jax.sharding.place_batch`), jits the step
with the plan's in/out shardings and buffer donation (`openhosti_jax.state.jit_step`), and makes the plan's gradient
shardings active so `TrainState.apply_gradients` reduce-scatters under ZeRO-2/3. ``step.plan`` is the decision the
step runs; ``step.report`` says why it was chosen and what happened since (an automatic microbatch, an
out-of-memory resize).

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import openhosti_jax as oh
    >>> mesh = oh.build_mesh(oh.MeshConfig(data=-1))
    >>> state, plan = oh.create_train_state(lambda r: {"w": jnp.zeros((4, 1))}, optax.sgd(0.1), mesh)
    >>> @oh.spmd(mesh=mesh, plan=plan)
    ... def step(state, batch):
    ...     loss, g = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2))(state.params)
    ...     return state.apply_gradients(grads=g), {"loss": loss}
    >>> state, m = step(state, {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 1))})
    >>> float(m["loss"])
    1.0
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from openhosti_jax.errors import BatchError, StateError, StepOutputError
from openhosti_jax.mesh.barrier import agree
from openhosti_jax.mesh.build import build_mesh, mesh_sizes
from openhosti_jax.mesh.config import AXES
from openhosti_jax.mesh.topology import target_mesh, tpu_target
from openhosti_jax.microbatch import OOMRetryStep, find_microbatch
from openhosti_jax.planner.aot import CompiledCheck, compile_check, lower_for
from openhosti_jax.planner.predict import parse_mesh
from openhosti_jax.policies.compiler import AppliedSettings, step_settings
from openhosti_jax.sharding.batch import batch_leaves, check_batch, place_batch
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import PlanReport
from openhosti_jax.sharding.zero import Optimizer
from openhosti_jax.state.call import static_arguments
from openhosti_jax.state.contracts import StepFn
from openhosti_jax.state.jit import jit_eval, jit_step
from openhosti_jax.state.layout import StateLayout, find_layout
from openhosti_jax.state.model import abstract
from openhosti_jax.state.train_state import TrainState
from openhosti_jax.train.compile_cache import CompileCache, caching_steps, enable_compile_cache
from openhosti_jax.train.create import PlanChoice, resolve_plan
from openhosti_jax.train.spmd_any import AnyCalls


def _optimizer(state: Any, shapes: Any, layout: StateLayout) -> Optimizer:
    """The state's optax transformation when it carries one whose state is the layout's optimizer state (flax's
    and the library's TrainState), else that abstract optimizer state itself (ZeRO mirrors it leaf by leaf)."""
    opt = layout.opt_state(shapes)
    tx = getattr(state, "tx", None)
    if isinstance(tx, optax.GradientTransformation) and opt is not None:
        if jax.tree.structure(jax.eval_shape(tx.init, layout.params(shapes))) == jax.tree.structure(opt):
            return tx
    return opt


class SpmdStep:
    """A train step jitted over a mesh by a plan; created by `spmd`. Call it as ``step(state, batch)``."""

    def __init__(
        self,
        fn: StepFn,
        mesh: Mesh | None,
        plan: PlanChoice | None,
        donate: bool,
        microbatch: int | str | None,
        memory_budget: int | None,
        plan_kw: dict,
        params: str | None = None,
        opt_state: str | None = None,
        skip_nonfinite: bool = True,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        compiler_settings: bool = True,
    ):
        functools.update_wrapper(self, fn)
        nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self._static = static_arguments(fn, nums, names)
        self._any = AnyCalls(self)
        self.skip_nonfinite = skip_nonfinite
        self._paths = {"params": params, "opt_state": opt_state}
        self.layout: StateLayout | None = None
        """Where the state keeps its parameters and optimizer state (after the first call)."""
        self.fn = fn
        self.mesh = mesh
        self._strategy = plan
        self.plan: ShardingPlan | None = plan if isinstance(plan, ShardingPlan) else None
        """The decision the step runs (its ``num_microbatches`` is the accumulation count in use)."""
        self.report: PlanReport | None = None
        """Why the plan was chosen, and the events since (after the first call)."""
        self.donate = donate
        self._microbatch = microbatch
        self.memory_budget = memory_budget
        self.microbatch_choice = None
        """The `MicrobatchChoice` of ``microbatch="auto"`` (after the first call)."""
        self._plan_kw = plan_kw
        self._jitted: dict[Any, tuple[Callable, Any]] = {}
        """(jitted step, state shardings) per (state treedef, batch treedef, microbatches)."""
        self._retry = None
        self._agreed = False
        self._plan_fn: StepFn | None = None
        self._where: Callable | None = None
        self.compiler_settings = compiler_settings
        self.compile_cache: CompileCache | None = None
        """Where compiled steps persist (`openhosti_jax.train.compile_cache`; after the first call)."""
        self.settings: AppliedSettings | None = None
        """The compiler settings the step compiles with (`openhosti_jax.policies.compiler`; after the first call)."""
        self.skipped_nonfinite: jax.Array | None = None
        """Whether the last call skipped a non-finite update (for steps of any other signature than
        ``(state, batch) -> (state, metrics)``, whose metrics report ``skipped_nonfinite`` instead)."""

    def _auto_plan_kw(self, state: Any, shapes: Any, batch: Any) -> dict[str, Any]:
        """What ``plan="auto"`` gives the planner from the first call: the real batch shapes, this step (to price
        from its jaxpr where no apply function takes the batch, and to AOT-compile the winner) with its abstract
        state (``shapes``), and the model's apply function if it takes the batch as given (keyword arguments given
        to `spmd` take precedence)."""
        rows = jax.process_count()

        def global_leaf(x: Any, split: bool) -> jax.ShapeDtypeStruct:
            shape = tuple(np.shape(x))
            if split and not isinstance(x, jax.Array):  # a process-local numpy batch
                shape = (shape[0] * rows, *shape[1:])
            return jax.ShapeDtypeStruct(shape, jax.numpy.result_type(x))

        leaves, treedef = jax.tree.flatten(batch)
        sample = treedef.unflatten([global_leaf(x, f) for x, f in zip(leaves, batch_leaves(batch), strict=True)])
        step_fn = self._plan_fn or self.fn
        kw: dict[str, Any] = {"sample_batch": sample, "step_fn": step_fn, "state": shapes, "layout": self.layout}
        apply_fn = state.apply_fn if isinstance(state, TrainState) else None
        model_state = shapes.model_state if apply_fn is not None else None
        if apply_fn is not None:
            try:  # activations and FLOPs come from apply_fn(params, batch): only if it takes the batch as given
                jax.eval_shape(lambda p, b: apply_fn(p, b, model_state=model_state), shapes.params, sample)
                kw.update(apply_fn=apply_fn, model_state=model_state)
            except Exception:  # noqa: BLE001 - e.g. a dict batch the model does not take: said in the report
                pass
        return {**kw, **self._plan_kw}

    def _refuse_pipelined(self) -> None:
        if self.plan is not None and self.plan.pipeline_stages > 1:
            raise StateError(
                f"the plan pipelines over {self.plan.pipeline_stages} stages, which @spmd does not run (it would "
                "replicate the step on every stage); make the state with create_train_state(..., plan=plan, "
                "sample_batch=...) and train it with openhosti_jax.pipeline_step(mean_loss_fn, mesh, state)"
            )

    def _resolve(self, state: Any, batch: Any = None) -> ShardingPlan:
        self._refuse_pipelined()
        if self.layout is None:
            self.layout = find_layout(state, **self._paths)
        if self.mesh is None:
            self.mesh = build_mesh()
        if self.plan is None or self.report is None:
            strategy = self.plan or self._strategy or "auto"
            shapes = abstract(state)
            kw = self._auto_plan_kw(state, shapes, batch) if strategy == "auto" and batch is not None else self._plan_kw
            params = self.layout.params(shapes)
            self.plan, self.report = resolve_plan(
                strategy, params, _optimizer(state, shapes, self.layout), self.mesh, **kw
            )
            self.plan.validate(params)
            self.report.record(f"state layout: {self.layout.describe(self._where)}")
            if strategy == "auto" and "apply_fn" not in kw and batch is not None:
                self.report.record(
                    "activations and FLOPs priced from the step's own jaxpr: no apply_fn(params, batch) takes the "
                    "batch as given (pass spmd(..., apply_fn=f) with f(params, batch, model_state=None) to use one)"
                )
        self._refuse_pipelined()
        self.plan.check_mesh(self.mesh)
        if jax.process_count() > 1 and not self._agreed:
            agree("spmd-plan", self.plan.digest())
            self._agreed = True
        return self.plan

    @property
    def num_microbatches(self) -> int:
        """Gradient-accumulation steps the step currently runs."""
        return self.plan.num_microbatches if self.plan is not None else 1

    @property
    def microbatch_rows(self) -> int | None:
        """Rows per device in one microbatch once the first call chose it (later batches keep it and run
        ``rows // microbatch_rows`` accumulation steps), None before."""
        return None if self._retry is None else self._retry.size

    def _compiled_fn(self, state: Any, batch: Any, k: int | None = None) -> tuple[Callable, Any]:
        plan = self._resolve(state, batch)
        k = k or plan.num_microbatches
        key = (jax.tree.structure(state), jax.tree.structure(batch), k)
        if key not in self._jitted:
            self._jitted[key] = jit_step(
                self.fn,
                plan,
                self.mesh,
                state,
                batch,
                donate=self.donate,
                num_microbatches=k,
                layout=self.layout,
                skip_nonfinite=self.skip_nonfinite,
                compiler_options=self.compiler_options(state),
            )
        return self._jitted[key]

    def _enable_cache(self) -> None:
        if self.compile_cache is None:
            self.compile_cache = enable_compile_cache()
            self.report.record(self.compile_cache.describe())

    def compiler_options(self, state: Any) -> dict[str, Any]:
        """The compiler options the step compiles with (`openhosti_jax.policies.compiler.step_settings` for this
        step's mesh, sized from the state's parameters), decided once and recorded in ``step.report``."""
        self._enable_cache()
        if self.settings is None:
            self.settings = step_settings(self.mesh, self.layout.params(abstract(state)), self.compiler_settings)
            self.report.record(self.settings.describe())
        return self.settings.options()

    def place(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """(state moved to the plan's shardings if it is not there yet, batch sharded over the data axes; PRNG keys
        in it replicated)."""
        check_batch(batch)
        _, state_sh = self._compiled_fn(state, batch)
        state = jax.tree.map(
            lambda x, s: x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s), state, state_sh
        )
        return state, place_batch(batch, self.mesh, self.plan.batch_spec)

    def lower(self, state: Any, batch: Any, num_microbatches: int | None = None) -> jax.stages.Lowered:
        """The lowered step for these (possibly abstract) arguments: ``.compile().memory_analysis()`` etc."""
        fn, _ = self._compiled_fn(state, batch, num_microbatches)
        with jax.set_mesh(self.mesh):
            return fn.lower(state, batch)

    def compile_for(
        self, target: Any, state: Any, batch: Any, *, mesh: Mapping[str, int] | str | None = None
    ) -> CompiledCheck:
        """This step compiled ahead of time for a TPU target that is not attached (``"v5p-128"``, ``"2xv5p-256"``,
        `openhosti_jax.mesh.topology`; libtpu needed, no TPU) on ``state`` and ``batch`` (arrays or
        `jax.ShapeDtypeStruct`, the global batch): planned there as this step plans (its strategy, or ``"auto"``:
        the planner verifies its choice by compiling for the target), over ``mesh`` (axis sizes, ``"fsdp=64"``;
        default: this step's mesh shape where the target has as many devices, else every chip on ``fsdp``, on
        ``data`` for ``plan="dp"``). Returns the `openhosti_jax.planner.aot.CompiledCheck`: the compiler's peak
        bytes per device beside the prediction, and whether it fits the chip. Nothing runs and nothing is
        allocated; this step's own plan and compiled programs are untouched."""
        t = tpu_target(target)
        if mesh is None and self.mesh is not None and self.mesh.size == t.n_devices:
            sizes = mesh_sizes(self.mesh)
        elif mesh is None:
            sizes = {"data" if self._strategy in ("dp", 0) else "fsdp": t.n_devices}
        else:
            sizes = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
        there = SpmdStep(
            self.fn,
            target_mesh(t, sizes, AXES),
            self._strategy,
            self.donate,
            None,
            self.memory_budget,
            self._plan_kw,
            self._paths["params"],
            self._paths["opt_state"],
            self.skip_nonfinite,
        )
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), (state, batch))
        there._where = self._where
        label = f"{' '.join(f'{a}={n}' for a, n in sizes.items() if n > 1)} ({there._strategy or 'auto'})"
        lowered = lower_for(lambda: there.lower(*shapes), t, label)
        label = f"{label} zero{there.plan.zero_stage}"
        predicted = float(there.report.predicted_bytes or 0) if there.report is not None else 0.0
        return compile_check(lowered, t, label, predicted_bytes=predicted)

    def evaluator(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``fn(state, batch) -> metrics`` (an eval step) jitted under this step's plan and mesh, without donation;
        the state must have been through this step (or be placed like it)."""
        cache: dict[Any, Callable] = {}

        def run(state: Any, batch: Any) -> Any:
            plan = self._resolve(state, batch)
            key = (jax.tree.structure(state), jax.tree.structure(batch))
            if key not in cache:
                cache[key] = jit_eval(fn, plan, self.mesh, state, batch, layout=self.layout)
            with jax.set_mesh(self.mesh):
                return cache[key](state, place_batch(batch, self.mesh, plan.batch_spec))

        return run

    def _per_device_batch(self, batch: Any) -> int:
        first = next((x for x, f in zip(jax.tree.leaves(batch), batch_leaves(batch), strict=True) if f), None)
        if first is None:
            raise BatchError(
                "the batch has no leaf with a batch dimension (PRNG keys are not batch data); expected arrays of "
                "shape (batch, ...)"
            )
        global_rows = np.shape(first)[0] * (jax.process_count() if not isinstance(first, jax.Array) else 1)
        return global_rows // self.plan.data_parallel_size

    def _set_microbatches(self, per_device: int, size: int) -> None:
        self.plan = dataclasses.replace(self.plan, num_microbatches=per_device // size)

    def _choose_microbatches(self, state: Any, batch: Any) -> None:
        per_device = self._per_device_batch(batch)
        if self._microbatch == "auto":
            choice = find_microbatch(
                lambda size: self.lower(state, batch, per_device // size).compile(), per_device, self.memory_budget
            )
            self.microbatch_choice = choice
            self.report.record(f"microbatch auto: {choice}")
            size = choice.size
        else:
            k = self._microbatch or self.plan.num_microbatches
            if per_device % k:
                raise BatchError(
                    f"microbatch={k} accumulation steps do not divide the per-device batch {per_device}; "
                    f"choose a divisor of {per_device}"
                )
            size = per_device // k

        def resized(old: int, new: int) -> None:
            self._set_microbatches(per_device, new)
            self.report.record(f"RESOURCE_EXHAUSTED at microbatch {old}: now {new}")

        self._retry = OOMRetryStep(self._run_with, per_device, size, on_resize=resized)
        self._set_microbatches(per_device, size)

    def _run_with(self, size: int) -> Callable[[Any, Any], tuple[Any, Any]]:
        def run(state: Any, batch: Any) -> tuple[Any, Any]:
            fn, _ = self._compiled_fn(state, batch, self._per_device_batch(batch) // size)
            with jax.set_mesh(self.mesh), caching_steps():
                return fn(state, batch)

        return run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the step: ``step(state, batch) -> (state, metrics)``, or any signature ``jax.jit`` takes (graph
        objects mutated in place, the state spread over several arguments; `openhosti_jax.train.spmd_any`)."""
        if self._any.active or not self._any.is_state_batch(args, kwargs):
            return self._any(args, kwargs)
        try:
            state, batch = self.place(*args)
            if self._retry is None:
                self._choose_microbatches(state, batch)
            out = self._retry(state, batch)
        except StepOutputError as err:  # e.g. flax's `return state`: runs as a step of any signature
            if self._any.ran_pairs:
                raise
            return self._any.fall_back(args, err)
        self._any.ran_pairs = True
        return out


def spmd(
    fn: StepFn | None = None,
    *,
    mesh: Mesh | None = None,
    plan: PlanChoice | None = None,
    donate: bool = True,
    microbatch: int | str | None = None,
    memory_budget: int | None = None,
    params: str | None = None,
    opt_state: str | None = None,
    skip_nonfinite: bool = True,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    compiler_settings: bool = True,
    **plan_kw: Any,
) -> SpmdStep | Callable[[Callable[..., Any]], SpmdStep]:
    """Decorate a train step to run sharded over ``mesh`` by ``plan``: ``train_step(state, batch) -> (state,
    metrics)``, or any step ``jax.jit`` / ``nnx.jit`` takes (`openhosti_jax.train.spmd_any`): nnx graph objects
    mutated in place (``train_step(model, optimizer, metrics, batch)``), the state spread over several arguments
    (``step(params, opt_state, batch) -> (params, opt_state, loss)``), PRNG keys, counters, and static arguments
    (``static_argnums`` / ``static_argnames``, as ``jax.jit`` takes them).

    ``plan`` is a `ShardingPlan`, a strategy (``"fsdp"``, ``"dp"``, ``"zero1"``, ``"zero2"``) or a ZeRO stage;
    naming none plans automatically (``"auto"``: the planner prices every candidate from the first call's batch and
    this step, AOT-compiles the winner, and takes the device calibration from this machine's cache after the first
    run, `openhosti_jax.planner.profile_cache`). ``mesh`` defaults to all devices on the ``data`` axis. The state
    is any pytree; ``params`` / ``opt_state`` (dotted paths such as ``"0"`` or ``"model.params"``; for a step of
    another signature, from the argument's position or keyword: ``"0"``, ``"1.opt_state"``) say where its
    parameters and optimizer state are when the automatic search (`openhosti_jax.state.layout.find_layout`) cannot tell.
    ``microbatch`` is the number of gradient-accumulation steps, or ``"auto"``: the largest per-device microbatch
    whose compiled peak fits ``memory_budget`` (default: the device's limit), found by AOT compiles. Steps built with
    `openhosti_jax.microbatch.make_train_step` accumulate over it; an out-of-memory step halves the microbatch and
    re-runs the same batch. Load balancing takes a loss rather than a step: `openhosti_jax.balanced_step`.
    ``skip_nonfinite`` (default on) leaves the state unchanged after a step whose loss, ``grad_norm`` or new
    parameters are not finite and reports ``skipped_nonfinite`` in the metrics (`openhosti_jax.state.guard`).
    On a GPU the step compiles with the settings MaxText's and JAX-Toolbox's recipes ship, sized from the model
    (`openhosti_jax.policies.compiler`; ``step.report`` lists them); options the user set in ``XLA_FLAGS`` win, and
    ``compiler_settings=False`` (or ``OPENHOSTI_GPU_SETTINGS=0``) sets none.
    """

    def build(f: StepFn) -> SpmdStep:
        return SpmdStep(
            f,
            mesh,
            plan,
            donate,
            microbatch,
            memory_budget,
            plan_kw,
            params,
            opt_state,
            skip_nonfinite,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            compiler_settings=compiler_settings,
        )

    return build if fn is None else build(fn)
