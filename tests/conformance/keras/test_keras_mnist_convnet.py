"""keras.io's "Simple MNIST convnet" (Sequential Conv2D / MaxPooling2D / Dropout, categorical crossentropy,
``fit(validation_split=0.1)``, ``evaluate``), on synthetic 16x16 digits, written for tf.distribute: the strategy's
scope around building and compiling, the batch size per replica times ``num_replicas_in_sync``. 540 training rows
in batches of 64 leave a partial last batch, and the 60-row validation split another."""

import pytest
from _keras_harness import assert_same, blobs, run, weights, worker

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def example(make_strategy, workdir):
    strategy = make_strategy()
    import keras
    from keras import layers

    num_classes, input_shape = 10, (16, 16, 1)
    x_train, y_train = blobs(600, input_shape)
    x_test, y_test = blobs(200, input_shape, seed=1)
    y_train = keras.utils.to_categorical(y_train, num_classes)
    y_test = keras.utils.to_categorical(y_test, num_classes)

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input(shape=input_shape),
                layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
                layers.MaxPooling2D(pool_size=(2, 2)),
                layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
                layers.MaxPooling2D(pool_size=(2, 2)),
                layers.Flatten(),
                layers.Dropout(0.5),
                layers.Dense(num_classes, activation="softmax"),
            ]
        )
        model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])

    batch_size = 8 * strategy.num_replicas_in_sync
    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=6, validation_split=0.1, verbose=0)
    score = model.evaluate(x_test, y_test, verbose=0)
    return {"history": history.history, "score": score, "weights": weights(model)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mnist_convnet_matches_one_device(tmp_path):
    out = run(__file__, tmp_path)
    single, mesh = out["single"], out["mesh"]
    assert_same(single, mesh, ["history", "score", "weights"])
    losses = mesh["history"]["loss"]
    assert losses[-1] < 0.75 * losses[0] and mesh["score"][1] > 0.5  # chance is 0.1


if __name__ == "__main__":
    worker(example)
