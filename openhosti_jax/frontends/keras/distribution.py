"""The ``keras.distribution`` a `Strategy` sets: its mesh, the batch over its batch axes, each variable's layout as
the strategy says, and the hooks Keras calls (datasets given to ``fit``, a layer's output).

Keras fixes a variable's layout when the variable is created and the data layout once per epoch; the strategy
answers both. A layer run while a TensorFlow ``GradientTape`` records (a TF-backend custom training loop) is an
`UnsupportedError`: the tape cannot see JAX arrays; so is a model that would train unjitted over the mesh
(`openhosti_jax.frontends.keras.jit`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from jax.sharding import Mesh

from openhosti_jax.errors import ShardingError, UnsupportedError
from openhosti_jax.frontends.keras._backend import install_partial_batches, keras_module, tf_gradient_tape_active
from openhosti_jax.frontends.keras.jit import install_jit_check

if TYPE_CHECKING:
    from openhosti_jax.frontends.keras.strategy import Strategy

Axes = tuple[str | tuple[str, ...] | None, ...]
"""A layout as Keras takes it: per dim, the mesh axis (or axes) it is split over, or None."""

TAPE_MESSAGE = (
    "a Keras layer ran while a TensorFlow GradientTape was recording: a TF-backend custom training loop cannot "
    "differentiate Keras on its JAX backend. Train with model.fit (a custom loss or metrics go to compile), or "
    "override Model.train_step with keras' JAX-backend pattern (jax.value_and_grad over model.stateless_call, as "
    "keras.io's 'Customizing what happens in fit() with JAX' writes it)"
)


@functools.cache
def distribution_class() -> type:
    """The ``keras.distribution.ModelParallel`` subclass a `Strategy` installs (made once keras is imported)."""
    keras = keras_module()

    class StrategyLayout(keras.distribution.TensorLayout):
        """A TensorLayout whose dims may name several mesh axes (``("data", "fsdp")``), as a PartitionSpec does."""

        def _validate_axes(self) -> None:
            if self._device_mesh is None:
                return
            named = {a for e in self._axes if e is not None for a in (e if isinstance(e, tuple) else (e,))}
            unknown = named - set(self._device_mesh.axis_names)
            if unknown:
                raise ShardingError(
                    f"expected layout axes among the mesh's {self._device_mesh.axis_names}, found {sorted(unknown)}; "
                    "name axes of the Strategy's mesh"
                )

    class StrategyDistribution(keras.distribution.ModelParallel):
        """Layouts, batches and dataset hooks answered by ``strategy`` on ``mesh``."""

        def __init__(self, strategy: Strategy, mesh: Mesh) -> None:
            device_mesh = keras.distribution.DeviceMesh(
                tuple(mesh.devices.shape), tuple(mesh.axis_names), list(mesh.devices.flat)
            )
            self.strategy, self.mesh = strategy, mesh
            super().__init__(
                layout_map=keras.distribution.LayoutMap(device_mesh), batch_dim_name=strategy.batch_axes[0]
            )

        @property
        def num_model_replicas(self) -> int:
            return self.strategy.num_replicas_in_sync

        def layout(self, axes: Axes) -> Any:
            """A Keras layout of ``axes`` on this mesh."""
            return StrategyLayout(tuple(axes), self.device_mesh)

        def get_data_layout(self, data_shape: Any) -> Any:
            batch = self.strategy.batch_axes
            first = batch[0] if len(batch) == 1 else tuple(batch)
            return self.layout((first,) + (None,) * (len(data_shape) - 1))

        def get_variable_layout(self, variable: Any) -> Any:
            if getattr(variable, "_layout", None) is not None:
                return variable._layout
            return self.layout(self.strategy.layout_of(variable))

        def get_tensor_layout(self, path: str) -> Any:
            if tf_gradient_tape_active():
                raise UnsupportedError(TAPE_MESSAGE)
            return None

        def distribute_dataset(self, dataset: Any) -> Any:
            if not getattr(dataset, "_openhosti_per_process", False):  # else already this process's share
                dataset = super().distribute_dataset(dataset)
            return self.strategy.positioned(dataset)

    install_partial_batches(StrategyDistribution)
    install_jit_check(StrategyDistribution, lambda d: d.mesh.size)
    return StrategyDistribution


def make_distribution(strategy: Strategy, mesh: Mesh) -> Any:
    """A Keras distribution of ``strategy`` on ``mesh``."""
    return distribution_class()(strategy, mesh)


__all__ = ["Axes", "TAPE_MESSAGE", "distribution_class", "make_distribution"]
