"""A learning-rate schedule and the usual callbacks, as keras.io's optimizer and callbacks guides write them:
``keras.optimizers.schedules.ExponentialDecay`` driving SGD with momentum, ``EarlyStopping`` (restoring the best
weights), ``CSVLogger``, ``TerminateOnNaN`` and a ``LambdaCallback`` recording the learning rate each epoch.
Distributed, the schedule reads the same step count and early stopping stops at the same epoch."""

import csv
import os

import pytest
from _keras_harness import assert_same, blobs, run, weights, worker

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def example(make_strategy, workdir):
    strategy = make_strategy()
    import keras
    import numpy as np

    x, y = blobs(512, (32,))
    x_val, y_val = blobs(128, (32,), seed=1)
    os.makedirs(workdir, exist_ok=True)

    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
        )
        lr_schedule = keras.optimizers.schedules.ExponentialDecay(
            initial_learning_rate=5e-2, decay_steps=10, decay_rate=0.8
        )
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=lr_schedule, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    rates = []
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=1e-3, patience=2, restore_best_weights=True),
        keras.callbacks.CSVLogger(os.path.join(workdir, "log.csv")),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: rates.append(float(np.asarray(model.optimizer.learning_rate)))
        ),
    ]
    history = model.fit(
        x,
        y,
        batch_size=4 * strategy.num_replicas_in_sync,
        epochs=30,
        validation_data=(x_val, y_val),
        callbacks=callbacks,
        verbose=0,
    )
    with open(os.path.join(workdir, "log.csv")) as f:
        logged = [float(row["loss"]) for row in csv.DictReader(f)]
    return {
        "history": history.history,
        "epochs": len(history.history["loss"]),
        "rates": rates,
        "logged": logged,
        "iterations": int(np.asarray(model.optimizer.iterations)),
        "val_accuracy": float(model.evaluate(x_val, y_val, verbose=0)[1]),
        "weights": weights(model),
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lr_schedule_and_callbacks_match_one_device(tmp_path):
    out = run(__file__, tmp_path)
    single, mesh = out["single"], out["mesh"]
    assert single["epochs"] == mesh["epochs"] < 20 and single["iterations"] == mesh["iterations"]  # stopped early
    assert_same(single, mesh, ["history", "rates", "logged", "weights", "val_accuracy"])
    assert mesh["rates"][-1] < 0.5 * mesh["rates"][0]  # the schedule decayed with the step count
    assert mesh["logged"] == pytest.approx(mesh["history"]["loss"], abs=1e-6)
    losses = mesh["history"]["loss"]
    assert losses[-1] < 0.5 * losses[0] and mesh["val_accuracy"] > 0.5  # chance is 0.1


if __name__ == "__main__":
    worker(example)
