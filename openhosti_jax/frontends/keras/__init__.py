"""Keras 3 models on the library's mesh, used as a ``tf.distribute.Strategy`` is used (`Strategy`).

Code written for ``tf.distribute`` runs unchanged but for the line that makes the strategy: ``num_replicas_in_sync``,
``scope()``, ``experimental_distribute_dataset``, ``distribute_datasets_from_function`` (with an `InputContext`),
``fit`` / ``evaluate`` / ``predict``, ``model.save`` and ``keras.saving.load_model``. Keras and TensorFlow are
imported when a `Strategy` is made, not with this package.
"""

from openhosti_jax.frontends.keras.data import InputContext
from openhosti_jax.frontends.keras.strategy import TF_ONLY, Strategy

__all__ = ["TF_ONLY", "InputContext", "Strategy"]
