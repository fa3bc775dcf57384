"""A functional-API model with BatchNormalization and Dropout (keras.io's functional API guide's style: a named
``keras.Input``, layers called on tensors, ``keras.Model(inputs, outputs)``), fed as the tf.distribute guide's
custom input pipeline: ``distribute_datasets_from_function`` with a ``dataset_fn(input_context)`` that shards by
input pipeline and batches by ``input_context.get_per_replica_batch_size``. BatchNorm's moving statistics are
compared with the trained weights, and ``predict`` in inference mode."""

import pytest
from _keras_harness import assert_same, blobs, run, weights, worker

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def example(make_strategy, workdir):
    strategy = make_strategy()
    import keras
    import tensorflow as tf
    from keras import layers

    global_batch_size = 8 * strategy.num_replicas_in_sync
    x_train, y_train = blobs(640, (48,))
    x_test, y_test = blobs(128, (48,), seed=1)

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.batch(batch_size).prefetch(2)

    with strategy.scope():
        inputs = keras.Input(shape=(48,), name="features")
        x = layers.Dense(96, name="dense_1")(inputs)
        x = layers.BatchNormalization(name="bn_1")(x)
        x = layers.Activation("relu")(x)
        x = layers.Dropout(0.3)(x)
        x = layers.Dense(64, activation="relu", name="dense_2")(x)
        x = layers.BatchNormalization(name="bn_2")(x)
        outputs = layers.Dense(10, name="predictions")(x)
        model = keras.Model(inputs=inputs, outputs=outputs, name="bn_dropout")
        model.compile(
            optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )

    history = model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=4, verbose=0)
    predictions = model.predict(x_test, batch_size=global_batch_size, verbose=0)
    accuracy = float((predictions.argmax(-1) == y_test).mean())
    moving = {w.path: w.numpy().tolist() for w in model.non_trainable_weights if "moving" in w.path}
    return {
        "history": history.history,
        "predictions": predictions.tolist(),
        "accuracy": accuracy,
        "moving": list(moving.values()),
        "weights": weights(model),
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_functional_bn_dropout_matches_one_device(tmp_path):
    out = run(__file__, tmp_path)
    single, mesh = out["single"], out["mesh"]
    assert_same(single, mesh, ["history", "predictions", "moving", "weights"])
    assert len(mesh["moving"]) == 4  # two BatchNorms' mean and variance
    losses = mesh["history"]["loss"]
    assert losses[-1] < 0.5 * losses[0] and mesh["accuracy"] > 0.5  # chance is 0.1


if __name__ == "__main__":
    worker(example)
