"""`Strategy`: Keras 3 models on the library's mesh, used as a ``tf.distribute.Strategy`` is used.

    strategy = Strategy()                      # every device on the mesh's data axis, parameters sharded (FSDP)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(tf_dataset, callbacks=[strategy.checkpoint("runs/x/ckpt", every_steps=100)])

Keras runs on its JAX backend (``KERAS_BACKEND=jax``, set here if keras is not imported yet) through
``keras.distribution``: the scope sets a `keras.distribution.ModelParallel` whose layouts are the plan's (``"fsdp"``:
each variable split over the data axis as ZeRO-3 splits it, small ones replicated; ``"dp"``: replicated), the batch
split over the data axis. It stays the process's distribution after the scope, so ``model.fit`` outside it trains
distributed. This is not a ``tf.distribute.Strategy`` subclass: custom train steps written for the TensorFlow
backend, ``tf.distribute`` collectives and ``experimental_distribute_dataset`` do not carry over.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from openhosti_jax.checkpoint import CheckpointManager
from openhosti_jax.errors import BridgeError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.sharding.specs import auto_spec


def _keras() -> Any:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    if keras.backend.backend() != "jax":
        raise BridgeError(
            f"keras runs on its {keras.backend.backend()!r} backend here; Strategy needs the JAX backend: set "
            "KERAS_BACKEND=jax before keras is first imported"
        )
    return keras


class Strategy:
    """Keras training over ``mesh`` (default: every device on ``data``) with the layouts of ``plan``."""

    def __init__(self, mesh: jax.sharding.Mesh | None = None, plan: str = "fsdp", data_axis: str = "data") -> None:
        if plan not in ("fsdp", "dp"):
            raise BridgeError(f"Strategy(plan={plan!r}): expected 'fsdp' (parameters sharded) or 'dp' (replicated)")
        keras = _keras()
        self.mesh = mesh if mesh is not None else build_mesh(MeshConfig(data=-1))
        self.plan, self.data_axis = plan, data_axis
        device_mesh = keras.distribution.DeviceMesh(
            tuple(self.mesh.devices.shape), tuple(self.mesh.axis_names), list(self.mesh.devices.flat)
        )
        strategy = self

        class _PlannedLayouts(keras.distribution.ModelParallel):
            def get_variable_layout(self, variable: Any) -> Any:
                return keras.distribution.TensorLayout(strategy.variable_axes(tuple(variable.shape)), device_mesh)

        self.distribution = _PlannedLayouts(
            layout_map=keras.distribution.LayoutMap(device_mesh), batch_dim_name=data_axis
        )

    def variable_axes(self, shape: tuple[int, ...]) -> tuple[str | None, ...]:
        """The mesh axis each dim of a variable of ``shape`` is split over (None: not split)."""
        if self.plan == "dp":
            return (None,) * len(shape)
        spec = auto_spec(shape, {self.data_axis: self.mesh.shape[self.data_axis]}, (self.data_axis,))
        axes = [None if e is None else (e if isinstance(e, str) else e[0]) for e in spec]
        return tuple(axes + [None] * (len(shape) - len(axes)))

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Build and compile models here; the distribution stays set afterwards (for ``fit``)."""
        _keras().distribution.set_distribution(self.distribution)
        yield self

    def check(self, model: Any) -> str:
        """A one-line summary of how ``model``'s variables lie on the mesh; a `BridgeError` if one was built outside
        the scope (on a single device)."""
        outside = [v.path for v in model.variables if len(v.value.sharding.device_set) < self.mesh.size]
        if outside:
            raise BridgeError(
                f"{len(outside)} variables of {model.name!r} (first {outside[0]!r}) are not on the strategy's mesh: "
                "the model was built outside strategy.scope(); build and compile it inside the scope"
            )
        split = sum(any(a is not None for a in self.variable_axes(tuple(v.shape))) for v in model.variables)
        return (
            f"plan {self.plan}: mesh {dict(self.mesh.shape)}, batch split over {self.data_axis!r}, "
            f"{split} of {len(model.variables)} variables split over {self.data_axis!r}, the rest replicated"
        )

    def checkpoint(self, directory: str | os.PathLike[str], *, every_steps: int = 100, keep: int = 3) -> Any:
        """A Keras callback: prints the plan, restores the newest good checkpoint when training begins (weights,
        optimizer state and its step count), and saves asynchronously every ``every_steps`` steps and at the end."""
        keras = _keras()
        strategy = self

        class OrbaxCheckpoint(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.manager = CheckpointManager(directory, every_minutes=None, every_steps=every_steps, keep=keep)
                self.restored_step: int | None = None

            def _variables(self) -> list[Any]:
                return list(self.model.variables) + list(self.model.optimizer.variables)

            def on_train_begin(self, logs: Any = None) -> None:
                print(strategy.check(self.model), flush=True)
                if self.manager.latest_good_step() is None:
                    return
                if not self.model.optimizer.built:
                    self.model.optimizer.build(self.model.trainable_variables)
                abstract = [
                    jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.value.sharding) for v in self._variables()
                ]
                values, _, _ = self.manager.restore(abstract)
                for v, value in zip(self._variables(), values, strict=True):
                    v.assign(value)
                self.restored_step = self.manager.restored_step
                print(f"resumed from step {self.restored_step}", flush=True)

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                step = int(np.asarray(self.model.optimizer.iterations.value))
                self.manager.maybe_save(step, [v.value for v in self._variables()])

            def on_train_end(self, logs: Any = None) -> None:
                step = int(np.asarray(self.model.optimizer.iterations.value))
                self.manager.maybe_save(step, [v.value for v in self._variables()], force=True)
                self.manager.wait()

        return OrbaxCheckpoint()
