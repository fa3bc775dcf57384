"""Keras and TensorFlow, imported lazily, and the two places Keras-on-JAX needs help under a `Strategy`.

`keras_module` imports Keras on its JAX backend. `install_partial_batches` lets a batch whose size does not divide
over the batch's mesh axes (the last one of an epoch, a ``validation_split``) run replicated instead of failing in
``jax.make_array_from_process_local_data``: Keras computes the data layout once per epoch, from the first batch.
`tf_gradient_tape_active` tells whether a TensorFlow ``GradientTape`` is recording, which cannot see JAX arrays.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import BatchError, BridgeError

_PATCHED: list[Any] = []


def keras_module() -> Any:
    """``keras``, on its JAX backend (``KERAS_BACKEND=jax`` is set if keras is not imported yet)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        import keras
    except ImportError as e:  # pragma: no cover - the extra is installed in the test environment
        raise BridgeError("openhosti_jax.frontends.keras needs Keras 3: pip install openhosti_jax[keras]") from e
    if keras.backend.backend() != "jax":
        raise BridgeError(
            f"keras runs on its {keras.backend.backend()!r} backend here; Strategy needs the JAX backend: set "
            "KERAS_BACKEND=jax before keras is first imported"
        )
    return keras


def tensorflow_module() -> Any:
    """``tensorflow`` (for tf.data inputs), or a `BridgeError` naming the extra to install."""
    try:
        import tensorflow as tf
    except ImportError as e:  # pragma: no cover - the extra is installed in the test environment
        raise BridgeError("tf.data inputs need TensorFlow: pip install openhosti_jax[tf]") from e
    return tf


def tf_gradient_tape_active() -> bool:
    """Whether a TensorFlow ``GradientTape`` is recording (False when TensorFlow was never imported)."""
    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import record

    return bool(record.could_possibly_record())


def batch_divides(shape: tuple[int, ...], sharding: NamedSharding) -> bool:
    """Whether the leading dim of a global batch of ``shape`` divides over the axes ``sharding`` splits it on."""
    if not shape or not len(sharding.spec) or sharding.spec[0] is None:
        return True
    axes = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
    ways = 1
    for a in axes:
        ways *= sharding.mesh.shape[a]
    return shape[0] % ways == 0


def install_partial_batches(owner: type) -> None:
    """Make Keras place a batch that does not divide over its batch axes replicated, while a distribution of
    class ``owner`` is the active one (other distributions are untouched). Installed once per process."""
    if _PATCHED:
        return
    keras = keras_module()
    from keras.src.backend.jax import distribution_lib as jax_lib

    original = jax_lib.distribute_data_input

    def distribute_data_input(per_process_batch: Any, layout: Any, batch_dim_name: Any) -> Any:
        sharding = layout.backend_layout if isinstance(layout, keras.distribution.TensorLayout) else layout
        active = keras.distribution.distribution()
        shape = tuple(getattr(per_process_batch, "shape", ()))
        if isinstance(active, owner) and isinstance(sharding, NamedSharding):
            rows = (shape[0] * jax.process_count(),) + shape[1:] if shape else shape
            if not batch_divides(rows, sharding):
                if jax.process_count() > 1:
                    raise BatchError(
                        f"a batch of {shape[0]} rows per process does not divide over the batch axes "
                        f"{sharding.spec[0]} of the mesh {dict(sharding.mesh.shape)}; batch with "
                        "drop_remainder=True in a multi-process run"
                    )
                sharding = NamedSharding(sharding.mesh, P())
        return original(per_process_batch, sharding, batch_dim_name)

    jax_lib.distribute_data_input = distribute_data_input
    _PATCHED.append(original)


__all__ = [
    "batch_divides",
    "install_partial_batches",
    "keras_module",
    "tensorflow_module",
    "tf_gradient_tape_active",
]
