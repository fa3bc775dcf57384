"""A Keras model that would train unjitted over a `Strategy`'s 8 devices (a ``RandomRotation`` inside it turns
``jit_compile`` off; so does ``run_eagerly=True``) is refused at ``fit``'s first step, naming the layer and the fix,
instead of stalling in a collective until XLA aborts. The fix (the layer in the ``tf.data`` pipeline) trains on the
mesh with the losses of the same code on one device.

Keras fixes its backend at its first import, so the case runs in a fresh process (this file is the worker)."""

import json
import os
import sys

import pytest
from _keras_subprocess import run_case

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def worker(case: str, directory: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np
    import tensorflow as tf

    from openhosti_jax.errors import UnsupportedError
    from openhosti_jax.frontends.keras import Strategy

    rs = np.random.RandomState(0)
    x, y = rs.rand(64, 8, 8, 1).astype("float32"), rs.randint(0, 4, 64)

    def build(rotate_inside: bool, **compile_kw):
        keras.utils.set_random_seed(0)
        inside = [keras.layers.RandomRotation(0.1, name="rotate")] if rotate_inside else []
        dense = [keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
        model = keras.Sequential([keras.Input((8, 8, 1)), *inside, *dense], name="net")
        loss = keras.losses.SparseCategoricalCrossentropy(True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, **compile_kw)
        return model

    def pipeline():  # keras.io's option 2: the augmentation in the tf.data pipeline, the model compilable
        rotate = keras.layers.RandomRotation(0.1, seed=3)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(lambda a, b: (rotate(a, training=True), b))

    out = {}
    strategy = Strategy(plan="dp")
    for name, kw in (("rotation", {}), ("eager", {"run_eagerly": True})):
        with strategy.scope():
            model = build(name == "rotation", **kw)
        try:
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0)
        except UnsupportedError as e:
            out[name] = str(e)
    with strategy.scope():
        model = build(False)
    out["mesh"] = model.fit(pipeline(), epochs=2, verbose=0).history["loss"]
    out["check"] = strategy.check(model)
    keras.distribution.set_distribution(None)  # the same code on one device
    out["one"] = build(False).fit(pipeline(), epochs=2, verbose=0).history["loss"]
    print("RESULT " + json.dumps(out), flush=True)


@pytest.mark.slow  # a fresh process importing Keras and TensorFlow: ~10 s on 2 loaded cores
@pytest.mark.timeout(300)
def test_a_layer_that_turns_jit_off_is_refused_at_fit_naming_it_and_the_pipeline_fix_trains(tmp_path):
    r = run_case(__file__, "jit", tmp_path, timeout=240)
    assert "model.fit would run model 'net' op by op over the Strategy's 8 devices" in r["rotation"], r
    assert "'rotate' (RandomRotation) set supports_jit = False" in r["rotation"]
    assert "into the tf.data pipeline" in r["rotation"] and "Working with preprocessing layers" in r["rotation"]
    assert "it was compiled with run_eagerly=True" in r["eager"], r
    assert r["mesh"] == pytest.approx(r["one"], rel=1e-5) and r["mesh"][1] < r["mesh"][0], r
    assert r["check"].startswith("plan dp: mesh {'data': 8}"), r


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
