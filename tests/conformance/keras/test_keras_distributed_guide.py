"""keras.io's "Multi-GPU distributed training with TensorFlow" guide: ``get_compiled_model()`` (a functional MLP,
Adam, from-logits crossentropy, SparseCategoricalAccuracy) built in ``strategy.scope()``, tf.data pipelines batched
by ``64 * strategy.num_replicas_in_sync`` passed through ``experimental_distribute_dataset``, ``fit`` with
``validation_data`` and the guide's fault-tolerance callback (``ModelCheckpoint`` to ``ckpt-{epoch}.keras``), then
its ``make_or_restore_model()`` loading the newest checkpoint inside the scope and evaluating it."""

import os

import pytest
from _keras_harness import assert_same, blobs, run, weights, worker

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def example(make_strategy, workdir):
    strategy = make_strategy()
    import keras
    import tensorflow as tf

    def get_compiled_model():
        inputs = keras.Input(shape=(64,))
        x = keras.layers.Dense(128, activation="relu")(inputs)
        x = keras.layers.Dense(128, activation="relu")(x)
        outputs = keras.layers.Dense(10)(x)
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
        return model

    def get_dataset():
        batch_size = 8 * strategy.num_replicas_in_sync
        num_val_samples = 128
        x, y = blobs(1152, (64,))
        x_test, y_test = blobs(256, (64,), seed=1)
        x_val, y_val = x[-num_val_samples:], y[-num_val_samples:]
        x_train, y_train = x[:-num_val_samples], y[:-num_val_samples]
        return (
            tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
            tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
            tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size),
        )

    checkpoint_dir = os.path.join(workdir, "ckpt")
    os.makedirs(checkpoint_dir, exist_ok=True)

    def make_or_restore_model():
        checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
        if checkpoints:
            latest_checkpoint = max(checkpoints, key=os.path.getctime)
            return keras.models.load_model(latest_checkpoint)
        return get_compiled_model()

    with strategy.scope():
        model = make_or_restore_model()
    train_dataset, val_dataset, test_dataset = get_dataset()
    callbacks = [keras.callbacks.ModelCheckpoint(filepath=checkpoint_dir + "/ckpt-{epoch}.keras", save_freq="epoch")]
    history = model.fit(
        strategy.experimental_distribute_dataset(train_dataset),
        epochs=3,
        validation_data=strategy.experimental_distribute_dataset(val_dataset),
        callbacks=callbacks,
        verbose=0,
    )
    score = model.evaluate(strategy.experimental_distribute_dataset(test_dataset), verbose=0)
    with strategy.scope():
        restored = make_or_restore_model()
    restored_score = restored.evaluate(test_dataset, verbose=0)
    on_mesh = all(len(v.value.sharding.device_set) == strategy.num_replicas_in_sync for v in restored.variables)
    return {
        "replicas": strategy.num_replicas_in_sync,
        "history": history.history,
        "score": score,
        "restored_score": restored_score,
        "restored_on_mesh": on_mesh,
        "checkpoints": sorted(os.listdir(checkpoint_dir)),
        "weights": weights(model),
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_distributed_guide_matches_one_device(tmp_path):
    out = run(__file__, tmp_path)
    single, mesh = out["single"], out["mesh"]
    assert single["replicas"] == mesh["replicas"] == 8
    assert_same(single, mesh, ["history", "score", "restored_score", "weights"])
    assert mesh["checkpoints"] == ["ckpt-1.keras", "ckpt-2.keras", "ckpt-3.keras"]
    assert mesh["restored_on_mesh"]  # load_model under the strategy builds onto the mesh
    assert mesh["restored_score"] == pytest.approx(mesh["score"], abs=1e-5)
    losses = mesh["history"]["loss"]
    assert losses[-1] < 0.5 * losses[0] and mesh["score"][1] > 0.5  # chance is 0.1


if __name__ == "__main__":
    worker(example)
