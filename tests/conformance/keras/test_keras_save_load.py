"""keras.io's "Save, serialize, and export models" guide: a model with a registered custom layer (``get_config``),
``model.save("my_model.keras")``, ``keras.models.load_model`` giving the same predictions, the reconstructed model
training on where the original left off (its optimizer state restored), and ``save_weights`` /
``load_weights`` into a freshly built model. Distributed, the loaded models are on the mesh."""

import os

import pytest
from _keras_harness import assert_same, blobs, run, weights, worker

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def example(make_strategy, workdir):
    strategy = make_strategy()
    import keras
    import numpy as np

    @keras.saving.register_keras_serializable(package="conformance")
    class Scale(keras.layers.Layer):
        def __init__(self, factor=1.0, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def build(self, input_shape):
            self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="gain")

        def call(self, inputs):
            return self.factor * inputs * self.gain

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}

    def get_model():
        inputs = keras.Input(shape=(32,))
        x = Scale(0.5)(inputs)
        x = keras.layers.Dense(64, activation="relu")(x)
        outputs = keras.layers.Dense(10)(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    os.makedirs(workdir, exist_ok=True)
    test_input, test_target = blobs(128, (32,))
    batch_size = 4 * strategy.num_replicas_in_sync
    with strategy.scope():
        model = get_model()
    model.fit(test_input, test_target, batch_size=batch_size, verbose=0)
    model.save(os.path.join(workdir, "my_model.keras"))

    with strategy.scope():
        reconstructed = keras.models.load_model(os.path.join(workdir, "my_model.keras"))
    same = float(np.abs(model.predict(test_input, verbose=0) - reconstructed.predict(test_input, verbose=0)).max())
    # "The reconstructed model is already compiled and has retained the optimizer state, so training can resume"
    model.fit(test_input, test_target, batch_size=batch_size, shuffle=False, verbose=0)
    reconstructed.fit(test_input, test_target, batch_size=batch_size, shuffle=False, verbose=0)
    resumed = float(np.abs(model.predict(test_input, verbose=0) - reconstructed.predict(test_input, verbose=0)).max())

    model.save_weights(os.path.join(workdir, "model.weights.h5"))
    with strategy.scope():
        fresh = get_model()
    fresh.load_weights(os.path.join(workdir, "model.weights.h5"))
    on_mesh = [
        all(len(v.value.sharding.device_set) == strategy.num_replicas_in_sync for v in m.variables)
        for m in (reconstructed, fresh)
    ]
    return {
        "same": same,
        "resumed": resumed,
        "fresh_predictions": fresh.predict(test_input, verbose=0).tolist(),
        "on_mesh": on_mesh,
        "weights": weights(model),
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_save_and_load_match_one_device(tmp_path):
    out = run(__file__, tmp_path)
    single, mesh = out["single"], out["mesh"]
    assert_same(single, mesh, ["fresh_predictions", "weights"])
    assert single["resumed"] < 1e-5
    assert mesh["same"] < 1e-6 and mesh["resumed"] < 1e-5  # the loaded model predicts, and trains on, the same
    assert mesh["on_mesh"] == [True, True]


if __name__ == "__main__":
    worker(example)
