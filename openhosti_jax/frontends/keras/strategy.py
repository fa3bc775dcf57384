"""`Strategy`: Keras 3 models on the library's mesh, used as a ``tf.distribute.Strategy`` is used.

    strategy = Strategy()                      # was: tf.distribute.MirroredStrategy()
    batch = 64 * strategy.num_replicas_in_sync
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(strategy.experimental_distribute_dataset(ds), callbacks=[strategy.checkpoint("runs/x/ckpt")])

Keras runs on its JAX backend through ``keras.distribution``: the scope sets the strategy's distribution, whose
variable layouts are the plan's (``"fsdp"``: each variable split over the data axis as ZeRO-3 splits it, small ones
replicated; ``"dp"``: replicated; ``"auto"``: the planner's choice, `openhosti_jax.frontends.keras.auto`) and which
splits each batch over the batch axes. It stays the process's distribution after the scope, so ``fit``, ``evaluate`` and
``predict`` outside it run distributed, and ``keras.saving.load_model`` builds onto the mesh. TensorFlow-only APIs
(``run``, ``reduce``, a ``GradientTape`` loop) raise `UnsupportedError` naming what to use instead.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from openhosti_jax.errors import BridgeError, UnsupportedError
from openhosti_jax.frontends.keras import auto
from openhosti_jax.frontends.keras._backend import keras_module
from openhosti_jax.frontends.keras.checkpoint import checkpoint_callback, save_minutes
from openhosti_jax.frontends.keras.data import DataPosition, InputContext, check_batched, from_function
from openhosti_jax.frontends.keras.distribution import Axes, make_distribution
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.mesh.config import BATCH_AXES
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.sharding.report import PlanReport
from openhosti_jax.sharding.specs import auto_spec

_FIT = "model.fit / evaluate / predict (Keras splits each batch over the mesh and XLA inserts the collectives)"
TF_ONLY: dict[str, str] = {
    "run": f"a per-replica function has no counterpart: the whole step is one program over the mesh; use {_FIT}, "
    "or override Model.train_step with keras' JAX-backend pattern",
    "reduce": "losses and metrics are already global (computed on the whole batch); read them from fit's History "
    "or evaluate's result",
    "gather": "values are global jax.Arrays: np.asarray(value) gathers one",
    "experimental_local_results": "values are global jax.Arrays, not per-replica: use the value itself",
    "experimental_distribute_values_from_function": f"there are no per-replica values; use {_FIT}",
    "experimental_run_v2": f"use {_FIT}",
    "extended": "there is no StrategyExtended: the mesh is strategy.mesh and each variable's layout strategy.check()",
    "cluster_resolver": "processes are started by openhosti_jax.mesh.initialize_distributed, not a cluster resolver",
}
"""tf.distribute.Strategy members with no equivalent here, and what to use instead."""


class Strategy:
    """Keras training over ``mesh`` (default: every device on ``data``) with the layouts of ``plan``.

    ``plan="auto"`` plans when the outermost scope closes, from the variables made inside it, within
    ``memory_budget`` bytes per device and on ``device_profile`` (the planner's defaults when None).
    Naming no plan plans automatically as well, where it can: on a mesh of ``data`` / ``fsdp`` axes only, and for a
    model built inside the scope. A model Keras builds lazily, outside the scope (at its first ``fit``), or a mesh
    with other axes takes the ``"fsdp"`` layouts instead, and `plan_report` says so.
    """

    def __init__(
        self,
        mesh: jax.sharding.Mesh | None = None,
        plan: str | None = None,
        data_axis: str = "data",
        *,
        memory_budget: int | None = None,
        device_profile: Any = None,
    ) -> None:
        self._keras = keras_module()
        self.mesh = mesh if mesh is not None else build_mesh(MeshConfig(data=-1))
        beyond = {a: n for a, n in self.mesh.shape.items() if a not in BATCH_AXES and n > 1}
        self._named = plan is not None
        """Whether the user named the plan (an unnamed one falls back to "fsdp" where "auto" cannot plan)."""
        self.fallback: str | None = None
        """Why an unnamed plan took the ``"fsdp"`` layouts instead of planning (None: it did not)."""
        if plan is None and beyond:
            self.fallback = f"Strategy(): the mesh has {beyond}, which the planner's Keras layouts do not cover: 'fsdp'"
        if plan is None:
            plan = "fsdp" if beyond else "auto"
        if plan not in ("fsdp", "dp", "auto"):
            raise BridgeError(
                f"Strategy(plan={plan!r}): expected 'fsdp' (parameters sharded), 'dp' (replicated) or 'auto' (the "
                "planner chooses)"
            )
        if plan == "auto" and beyond:
            raise BridgeError(
                f"Strategy(plan='auto') plans data x fsdp meshes; the given mesh also has {beyond}: pass no mesh (or "
                "one of data and fsdp only), or use plan='fsdp' / 'dp' with this mesh"
            )
        self.plan, self.data_axis = plan, data_axis
        self.batch_axes: tuple[str, ...] = (
            tuple(a for a in BATCH_AXES if a in self.mesh.shape) if plan == "auto" else (data_axis,)
        )
        self.memory_budget, self.device_profile = memory_budget, device_profile
        self.sharding_plan: ShardingPlan | None = None
        """``plan="auto"``: the planner's plan for the last scope's model."""
        self.plan_report: PlanReport | None = None
        """``plan="auto"``: why the planner chose it (`openhosti_jax.sharding.report.PlanReport`)."""
        self.data_position = DataPosition()
        self._planned: dict[str, tuple[tuple[int, ...], Axes]] = {}
        self._made: list[weakref.ref] = []
        self._optimizer: Any = None
        self._depth = 0
        self._trained_in_scope = 0
        self._fixed_mesh = mesh is not None
        self.distribution = make_distribution(self, self.mesh)

    @property
    def num_replicas_in_sync(self) -> int:
        """How many ways each global batch is split (every device for the default mesh), as tf.distribute says."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def variable_axes(self, shape: tuple[int, ...]) -> tuple[str | None, ...]:
        """The mesh axis each dim of a variable of ``shape`` is split over under ``"fsdp"`` / ``"dp"``."""
        if self.plan == "dp":
            return (None,) * len(shape)
        spec = auto_spec(shape, {self.data_axis: self.mesh.shape[self.data_axis]}, (self.data_axis,))
        axes = [None if e is None else (e if isinstance(e, str) else e[0]) for e in spec]
        return tuple(axes + [None] * (len(shape) - len(axes)))

    def layout_of(self, variable: Any) -> Axes:
        """The layout of a variable Keras is creating (called by the distribution)."""
        shape = tuple(variable.shape)
        if self.plan != "auto":
            return self.variable_axes(shape)
        self._trained_in_scope += bool(self._depth and variable.trainable)
        planned = self._planned.get(variable.path)
        if planned is not None and planned[0] == shape:
            return planned[1]
        if self._depth:  # inside the scope: replicated until the scope closes and the planner decides
            self._made.append(weakref.ref(variable))
            self._note_optimizer()
            return (None,) * len(shape)
        if self.sharding_plan is None and variable.trainable and not self._named:
            self._fall_back(f"variable {variable.path!r} was made outside strategy.scope() (a model built lazily)")
            return self.variable_axes(shape)
        if self.sharding_plan is None and variable.trainable:
            raise BridgeError(
                f"plan='auto': variable {variable.path!r} was made outside strategy.scope() before any plan: the "
                "planner plans the model built inside the scope; build it there (keras.Input(...) or "
                "model.build(input_shape)), or use plan='fsdp' or 'dp'"
            )
        if self.sharding_plan is None:
            return (None,) * len(shape)
        return auto.layout_for(self.sharding_plan, shape, variable.dtype)

    def _note_optimizer(self) -> None:
        from keras.src.backend.common import global_state

        for scope in global_state.get_global_attribute("name_scope_stack") or []:
            if isinstance(getattr(scope, "caller", None), self._keras.optimizers.Optimizer):
                self._optimizer = scope.caller

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Build and compile models here; the distribution stays set afterwards (for ``fit``)."""
        self._keras.distribution.set_distribution(self.distribution)
        if not self._depth:
            self._trained_in_scope = 0
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
        if self.plan == "auto" and not self._depth:
            if not self._trained_in_scope and not self._named:
                return  # nothing to plan yet: a model built lazily later takes the "fsdp" layouts (_fall_back)
            if not self._trained_in_scope:
                raise BridgeError(
                    "plan='auto' plans the trainable variables made inside strategy.scope() and none were: build "
                    "the model there (keras.Input(...) or model.build(input_shape)), or use plan='fsdp' or 'dp'"
                )
            self._plan_made_variables()

    def _fall_back(self, why: str) -> None:
        """Take the ``"fsdp"`` layouts from now on: the default plan could not be automatic (``why``)."""
        self.plan, self.batch_axes = "fsdp", (self.data_axis,)
        self.plan_report = None
        self.fallback = (
            f"Strategy(): {why}, so the planner could not see the model; it takes the 'fsdp' layouts. Build the "
            "model inside strategy.scope() (keras.Input(...) or model.build(input_shape)) to have it planned"
        )
        warnings.warn(self.fallback, stacklevel=4)

    def _plan_made_variables(self) -> None:
        """Plan the trainable variables made in the scope and move every variable made there to the plan."""
        made = [v for r in self._made if (v := r()) is not None]
        self._made = []
        params = {v.path: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in made if v.trainable}
        if not params:
            return
        slots = auto.DEFAULT_SLOTS if self._optimizer is None else auto.slot_count(self._keras, self._optimizer)
        fixed = self.sharding_plan.mesh_shape if self.sharding_plan is not None else None
        if self._fixed_mesh:
            fixed = {a: self.mesh.shape.get(a, 1) for a in ("stage", "data", "fsdp", "tensor")}
        devices = list(self.mesh.devices.flat)
        plan, report = auto.plan_variables(
            params,
            devices,
            slots=slots,
            global_batch=len(devices),
            memory_budget=self.memory_budget,
            device_profile=self.device_profile,
            mesh_shape=fixed,
        )
        self.sharding_plan, self.plan_report, self._optimizer = plan, report, None
        if {a: self.mesh.shape.get(a, 1) for a in plan.mesh_shape} != dict(plan.mesh_shape):
            self.mesh = build_mesh(MeshConfig.from_sizes(dict(plan.mesh_shape)), devices)
            self.distribution = make_distribution(self, self.mesh)
            self._keras.distribution.set_distribution(self.distribution)
        for path, spec in plan.param_specs.items():
            self._planned[path] = (tuple(params[path].shape), auto.spec_axes(spec, len(params[path].shape)))
        for v in made:
            v._layout = self.distribution.layout(self.layout_of(v))
            v.assign(v.value)  # Keras places the value by the variable's new layout

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """``dataset`` (batched by the global batch size) as ``fit`` / ``evaluate`` / ``predict`` take it."""
        return check_batched(dataset, "experimental_distribute_dataset")

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any], options: Any = None) -> Any:
        """This process's pipeline from ``dataset_fn(input_context)`` (batched per replica), as one dataset of
        this process's share of each global batch."""
        processes = jax.process_count()
        context = InputContext(processes, jax.process_index(), self.num_replicas_in_sync)
        return from_function(dataset_fn, context, max(1, self.num_replicas_in_sync // processes))

    def positioned(self, dataset: Any) -> Any:
        """``dataset`` as Keras will read it: through the data position when a checkpoint resumes."""
        return self.data_position.wrap(dataset)

    def check(self, model: Any) -> str:
        """A one-line summary of how ``model``'s variables lie on the mesh; a `BridgeError` if one was built outside
        the scope (on a single device)."""
        outside = [v.path for v in model.variables if len(v.value.sharding.device_set) < self.mesh.size]
        if outside:
            raise BridgeError(
                f"{len(outside)} variables of {model.name!r} (first {outside[0]!r}) are not on the strategy's mesh: "
                "the model was built outside strategy.scope(); build and compile it inside the scope"
            )
        split = sum(not v.value.sharding.is_fully_replicated for v in model.variables)
        label = self.plan if self.sharding_plan is None else f"auto (zero{self.sharding_plan.zero_stage})"
        sizes = {k: int(n) for k, n in self.mesh.shape.items() if n > 1}
        return (
            f"plan {label}: mesh {sizes}, batch split over {'x'.join(self.batch_axes)!r}, "
            f"{split} of {len(model.variables)} variables split, the rest replicated"
        )

    def checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        every_minutes: float | None = None,
        keep: int | None = 3,
        clock: Callable[[], float] = time.monotonic,
        replicate_to: str | os.PathLike[str] | None = None,
    ) -> Any:
        """A Keras callback: prints the plan, restores the newest good checkpoint when training begins (weights,
        optimizer state, step count and data position) and saves asynchronously every ``every_steps`` steps and/or
        every ``every_seconds`` (or ``every_minutes``, by ``clock``), and at the end; every 100 steps when no
        schedule is given."""
        minutes = save_minutes(every_seconds, every_minutes)
        if every_steps is None and minutes is None:
            every_steps = 100
        return checkpoint_callback(
            self,
            directory,
            every_steps=every_steps,
            every_minutes=minutes,
            keep=keep,
            clock=clock,
            replicate_to=replicate_to,
        )

    def run(self, fn: Callable[..., Any], args: Any = (), kwargs: Any = None, options: Any = None) -> Any:
        """Not available: `UnsupportedError` (see `TF_ONLY`)."""
        raise UnsupportedError(f"strategy.run: {TF_ONLY['run']}")

    def reduce(self, reduce_op: Any, value: Any, axis: Any = None) -> Any:
        """Not available: `UnsupportedError` (see `TF_ONLY`)."""
        raise UnsupportedError(f"strategy.reduce: {TF_ONLY['reduce']}")

    def __getattr__(self, name: str) -> Any:
        if name in TF_ONLY:
            raise UnsupportedError(f"strategy.{name}: {TF_ONLY[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


__all__ = ["TF_ONLY", "Strategy"]
