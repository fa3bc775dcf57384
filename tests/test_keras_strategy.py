"""`openhosti_jax.frontends.keras.Strategy`: a Keras model trained from a tf.data pipeline on 8 devices equals the same
model on one device, its kernels split as the plan says, and it resumes from its checkpoint as if never stopped.

Keras fixes its backend at its first import, so each case runs in a fresh process (this file is the worker)."""

import json
import os
import sys

import pytest
from _keras_subprocess import run_case

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def _model(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)], name="mlp"
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


def _data(tf, start: int, stop: int):
    rs = __import__("numpy").random.RandomState(0)
    x, y = rs.randn(80, 32).astype("float32"), rs.randint(0, 10, 80)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).skip(start).take(stop - start)


def worker(case: str, directory: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np
    import tensorflow as tf

    from openhosti_jax.errors import BridgeError
    from openhosti_jax.frontends.keras import Strategy

    out = {}
    if case == "single":  # plain Keras on one device, no distribution
        model = _model(keras)
        model.fit(_data(tf, 0, 5), epochs=1, verbose=0)
    elif case == "outside":
        strategy = Strategy(plan="fsdp")
        model = _model(keras)  # before the scope
        try:
            model.fit(_data(tf, 0, 1), epochs=1, verbose=0, callbacks=[strategy.checkpoint(directory)])
        except BridgeError as e:
            out["error"] = str(e)
        print("RESULT " + json.dumps(out), flush=True)
        return
    else:
        strategy = Strategy(plan="fsdp")
        with strategy.scope():
            model = _model(keras)
        kernel = model.layers[0].kernel.value
        out["kernel_local"] = list(kernel.addressable_shards[0].data.shape)
        if case == "mesh":
            model.fit(_data(tf, 0, 5), epochs=1, verbose=0)
        else:  # resume: 3 steps saved, then a new process-equivalent model picks up at step 3
            cb = strategy.checkpoint(directory, every_steps=3)
            model.fit(_data(tf, 0, 3), epochs=1, verbose=0, callbacks=[cb])
            with strategy.scope():
                model = _model(keras)
            cb = strategy.checkpoint(directory, every_steps=3)
            model.fit(_data(tf, 3, 5), epochs=1, verbose=0, callbacks=[cb])
            out["restored_step"] = cb.restored_step
    out["weights"] = [np.asarray(w).tolist() for w in model.get_weights()]
    out["iterations"] = int(np.asarray(model.optimizer.iterations.value))
    print("RESULT " + json.dumps(out), flush=True)


def _run(case: str, tmp_path) -> dict:
    return run_case(__file__, case, tmp_path, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eight_devices_equal_one_and_resume(tmp_path):
    pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    import numpy as np

    single, mesh, resumed = (_run(c, tmp_path) for c in ("single", "mesh", "resume"))
    assert mesh["kernel_local"] == [32, 256 // 8] or mesh["kernel_local"] == [32 // 8, 256]  # split 8 ways
    for a, b in zip(single["weights"], mesh["weights"], strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    assert resumed["restored_step"] == 3 and resumed["iterations"] == 5
    for a, b in zip(mesh["weights"], resumed["weights"], strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    outside = _run("outside", tmp_path)
    assert "built outside strategy.scope()" in outside["error"]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
