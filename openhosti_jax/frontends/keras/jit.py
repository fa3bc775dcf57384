"""A Keras model that would train op by op across a `Strategy`'s mesh is refused at ``fit``'s first step.

A layer that cannot be compiled sets ``supports_jit = False`` (``RandomRotation``, ``RandomZoom``,
``RandomTranslation``, ``RandomCrop``, the lookup and hashing layers), and Keras then turns ``jit_compile`` off for the
whole model; ``run_eagerly=True`` or ``jit_compile=False`` do the same. Unjitted, every op of the step is dispatched
on its own over the mesh's devices, and on CPU devices such a step stalls in a collective until XLA aborts the
process, with no word from Keras. So when the active distribution is a `Strategy`'s over more than one device,
building the train (test, predict) function raises `UnsupportedError` naming the layers and the fix: run them in the
``tf.data`` pipeline (``dataset.map(lambda x, y: (rotate(x, training=True), y))``, option 2 of keras.io's
"Working with preprocessing layers"), where they run on the host CPU, asynchronously, as TensorFlow ops, and keep
the model's layers compilable. A single-device distribution is left alone.
"""

from __future__ import annotations

import functools
from typing import Any

from openhosti_jax.errors import UnsupportedError

FIX = (
    "move them out of the model into the tf.data pipeline, applying each layer itself in a map, e.g. "
    "dataset.map(lambda x, y: (rotate(x, training=True), y), num_parallel_calls=tf.data.AUTOTUNE) with rotate = "
    "keras.layers.RandomRotation(...), as option 2 of keras.io's 'Working with preprocessing layers' guide does "
    "(there they run as TensorFlow ops on the host while the devices train; a keras.Sequential of them would not "
    "switch to TensorFlow ops on the JAX backend), and keep the model itself compilable"
)


def unjittable_layers(model: Any) -> list[str]:
    """``name (Class)`` of every layer of ``model`` that sets ``supports_jit = False``."""
    return [f"{x.name!r} ({type(x).__name__})" for x in model._flatten_layers() if not x.supports_jit]


def check_jit(model: Any, devices: int, what: str) -> None:
    """`UnsupportedError` when ``model``'s ``what`` function (``fit``, ``evaluate``, ``predict``) would run without
    jit over a mesh of ``devices`` > 1."""
    if devices <= 1 or (model.jit_compile and not model.run_eagerly):
        return
    layers = unjittable_layers(model)
    if layers:
        cause = (
            f"its layer(s) {', '.join(layers)} set supports_jit = False, so Keras turned jit_compile off for the "
            f"whole model; fix: {FIX}"
        )
    else:
        flag = "run_eagerly=True" if model.run_eagerly else "jit_compile=False"
        cause = f"it was compiled with {flag}; fix: compile it with jit_compile='auto' (the default) and no run_eagerly"
    raise UnsupportedError(
        f"model.{what} would run model {model.name!r} op by op over the Strategy's {devices} devices (expected a "
        f"jit-compiled step; unjitted, a step stalls in a collective until XLA aborts): {cause}"
    )


def install_jit_check(owner: type, devices: Any) -> None:
    """Check `check_jit` when Keras builds a model's train, test or predict function while a distribution of class
    ``owner`` is active (``devices(distribution)``: its device count). Installed once per process."""
    from keras.src.backend.jax.trainer import JAXTrainer
    from keras.src.distribution import distribution

    if getattr(JAXTrainer, "_openhosti_jit_checked", False):
        return
    for name, what in (
        ("make_train_function", "fit"),
        ("make_test_function", "evaluate"),
        ("make_predict_function", "predict"),
    ):
        original = getattr(JAXTrainer, name)

        @functools.wraps(original)
        def checked(self: Any, force: bool = False, _original: Any = original, _what: str = what) -> Any:
            active = distribution()
            if isinstance(active, owner):
                check_jit(self, devices(active), _what)
            return _original(self, force=force)

        setattr(JAXTrainer, name, checked)
    JAXTrainer._openhosti_jit_checked = True


__all__ = ["FIX", "check_jit", "install_jit_check", "unjittable_layers"]
