"""`openhosti_jax.frontends.keras.Strategy` read as tf.distribute code reads it: ``num_replicas_in_sync``, the two
dataset entry points and their `InputContext`, a resumed ``fit`` that continues from its data position (which batches it
trains is counted), time- and step-based saves, ``plan="auto"`` through the planner, and a typed error for each
TensorFlow-only API.

Keras fixes its backend at its first import, so each case runs in a fresh process (this file is the worker)."""

import json
import os
import sys
import warnings

import pytest
from _keras_subprocess import run_case

pytestmark = pytest.mark.tf  # needs the keras and tf extras


def _mlp(keras, hidden=64):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


def _arrays(n=160):
    import numpy as np

    rs = np.random.RandomState(0)
    return rs.randn(n, 32).astype("float32"), rs.randint(0, 10, n)


def _pipeline(tf, batches=10):
    """``batches`` batches of 16, in the same order every pass."""
    x, y = _arrays(16 * batches)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def _per_batch(means):
    """Each batch's loss from Keras's per-epoch running means ``[(epoch, mean), ...]`` (equal batch sizes)."""
    out, count = [], 0
    for i, (epoch, mean) in enumerate(means):
        count = count + 1 if i and means[i - 1][0] == epoch else 1
        out.append(count * mean - (count - 1) * means[i - 1][1] if count > 1 else mean)
    return out


def case_api(keras, tf, out, directory):
    import numpy as np

    from openhosti_jax.errors import BatchError, BridgeError, UnsupportedError
    from openhosti_jax.frontends.keras import Strategy
    from openhosti_jax.mesh import MeshConfig, build_mesh

    strategy = Strategy()
    out["replicas"] = strategy.num_replicas_in_sync
    out["tensor_mesh_replicas"] = Strategy(build_mesh(MeshConfig(data=2, tensor=4))).num_replicas_in_sync
    x, y = _arrays()
    seen_context = {}

    def dataset_fn(context):
        seen_context.update(pipelines=context.num_input_pipelines, id=context.input_pipeline_id)
        per_replica = context.get_per_replica_batch_size(8 * strategy.num_replicas_in_sync)
        seen_context["per_replica"] = per_replica
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)

    from_fn = strategy.distribute_datasets_from_function(dataset_fn)
    whole = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(64))
    out["context"] = seen_context
    out["same_batches"] = all(
        np.array_equal(a[0].numpy(), b[0].numpy()) and np.array_equal(a[1].numpy(), b[1].numpy())
        for a, b in zip(from_fn, whole, strict=True)
    )
    errors = {}
    for name, call in {
        "per_replica": lambda: _per_replica(strategy),
        "unbatched": lambda: strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y))),
        "run": lambda: strategy.run(lambda: 0),
        "reduce": lambda: strategy.reduce("SUM", 1.0, axis=None),
        "gather": lambda: strategy.gather(1.0, axis=0),
        "extended": lambda: strategy.extended,
        "missing": lambda: strategy.not_an_api,
        "auto_tensor_mesh": lambda: Strategy(build_mesh(MeshConfig(data=2, tensor=4)), plan="auto"),
        "unknown_plan": lambda: Strategy(plan="zero2"),
    }.items():
        try:
            call()
            errors[name] = None
        except (BatchError, BridgeError, UnsupportedError, AttributeError) as e:
            errors[name] = [type(e).__name__, isinstance(e, NotImplementedError), str(e)]
    with strategy.scope():
        model = _mlp(keras)
    try:  # a TF-backend custom training loop, as tf.distribute guides write one
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y[:16], model(tf.constant(x[:16])), from_logits=True)
        tape.gradient(loss, model.trainable_weights)
        errors["tape"] = None
    except UnsupportedError as e:
        errors["tape"] = [type(e).__name__, True, str(e)]
    out["errors"] = errors


def _per_replica(strategy):
    from openhosti_jax.frontends.keras import InputContext

    return InputContext(1, 0, strategy.num_replicas_in_sync).get_per_replica_batch_size(30)


def case_resume(keras, tf, out, directory):
    """An uninterrupted 2-epoch fit; then a fit that crashes after 7 batches (steps 2, 4, 6 saved) and a new model
    that resumes it. Each batch trained is identified by its loss: the same weights on the same batch give it."""
    import numpy as np

    from openhosti_jax.frontends.keras import Strategy

    class Crash(keras.callbacks.Callback):  # preempted after the 7th batch trained
        def on_train_batch_end(self, batch, logs=None):
            if int(np.asarray(self.model.optimizer.iterations.value)) == 7:
                raise RuntimeError("preempted")

    class Losses(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_begin(self, logs=None):
            self.means = []

        def on_train_batch_end(self, batch, logs=None):
            self.means.append((self.epoch, float(logs["loss"])))

    def fit(callbacks, repeat=False):
        with strategy.scope():
            model = _mlp(keras)
        losses = Losses()
        data, kw = (_pipeline(tf).repeat(), {"steps_per_epoch": 4, "epochs": 4}) if repeat else (_pipeline(tf), {})
        try:
            model.fit(data, **({"epochs": 2} | kw), verbose=0, callbacks=[losses, *callbacks])
        except RuntimeError:
            pass
        return model, _per_batch(losses.means)

    strategy = Strategy()
    straight, out["straight"] = fit([])
    cb = strategy.checkpoint(os.path.join(directory, "ckpt"), every_steps=2)
    _, out["crashed"] = fit([cb, Crash()])
    cb.manager.wait()  # the saves started before the crash are on disk
    cb = strategy.checkpoint(os.path.join(directory, "ckpt"), every_steps=2)
    resumed, out["resumed"] = fit([cb])
    out["restored"] = [cb.restored_step, cb.restored_data]
    out["iterations"] = int(np.asarray(resumed.optimizer.iterations.value))
    out["max_diff"] = max(
        float(np.abs(a - b).max()) for a, b in zip(straight.get_weights(), resumed.get_weights(), strict=True)
    )
    # a finished fit is not resumed: the next fit trains on over its own data from the start
    cb = strategy.checkpoint(os.path.join(directory, "ckpt"), every_steps=2)
    _, out["after_finished"] = fit([cb])
    out["after_finished_restored"] = cb.restored_step
    # a repeated pipeline with steps_per_epoch: Keras keeps one iterator across epochs, so the skip counts them all
    _, out["repeat_straight"] = fit([], repeat=True)
    cb = strategy.checkpoint(os.path.join(directory, "repeat"), every_steps=2)
    fit([cb, Crash()], repeat=True)
    cb.manager.wait()
    cb = strategy.checkpoint(os.path.join(directory, "repeat"), every_steps=2)
    _, out["repeat_resumed"] = fit([cb], repeat=True)
    out["repeat_restored"] = cb.restored_data


def case_saves(keras, tf, out, directory):
    """Saves by time alone: every step when steps take longer than the interval, only the last when they never do."""
    from openhosti_jax.frontends.keras import Strategy

    now = [0.0]

    class Slow(keras.callbacks.Callback):  # each batch takes 0.3 s on the save schedule's (injected) clock
        def on_train_batch_end(self, batch, logs=None):
            now[0] += 0.3

    strategy = Strategy()
    x, y = _arrays(96)
    for name, kw in {"seconds": {"every_seconds": 0.2}, "minutes": {"every_minutes": 60}}.items():
        with strategy.scope():
            model = _mlp(keras)
        cb = strategy.checkpoint(os.path.join(directory, name), keep=None, clock=lambda: now[0], **kw)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[Slow(), cb])
        out[name] = [cb.saved_steps, cb.manager.good_steps()]


def case_auto(keras, tf, out, directory):
    """plan='auto' under a memory budget that replicated Adam state does not fit, and without one."""
    import numpy as np

    from openhosti_jax.errors import BridgeError
    from openhosti_jax.frontends.keras import Strategy

    x, y = _arrays(80)
    keras.distribution.set_distribution(None)
    single = _mlp(keras, hidden=4096)  # plain Keras on one device
    single.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for name, budget in {"budget": 1_500_000, "free": None}.items():
        strategy = Strategy(plan="auto", memory_budget=budget, device_profile="H100")
        with strategy.scope():
            model = _mlp(keras, hidden=4096)
        plan = strategy.sharding_plan
        kernel_local = list(model.layers[0].kernel.value.addressable_shards[0].data.shape)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        out[name] = {
            "zero": plan.zero_stage,
            "mesh": {k: int(v) for k, v in plan.mesh_shape.items()},
            "kernel_local": kernel_local,
            "check": strategy.check(model),
            "notes": list(strategy.plan_report.notes),
            "max_diff": max(
                float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), model.get_weights(), strict=True)
            ),
        }

    class Lazy(keras.Model):  # subclassed, built at its first call: inside fit, after the scope closed
        def __init__(self, width=10):
            super().__init__()
            self.dense = keras.layers.Dense(width)

        def call(self, inputs):
            return self.dense(inputs)

    strategy = Strategy(plan="auto", device_profile="H100")
    try:
        with strategy.scope():
            lazy = Lazy()
            lazy.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
        out["lazy"] = None
    except BridgeError as e:
        out["lazy"] = str(e)

    # naming no plan: the model built in the scope is planned; a lazily built one takes the "fsdp" layouts, said
    strategy = Strategy(device_profile="H100")
    with strategy.scope():
        model = _mlp(keras, hidden=4096)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    out["default"] = {
        "planned": strategy.sharding_plan is not None and strategy.plan_report is not None,
        "zero": strategy.sharding_plan.zero_stage,
        "max_diff": max(
            float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), model.get_weights(), strict=True)
        ),
    }
    strategy = Strategy(device_profile="H100")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with strategy.scope():
            lazy = Lazy(4096)
            lazy.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
        history = lazy.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    out["default_lazy"] = {
        "fallback": strategy.fallback,
        "warned": any("'fsdp' layouts" in str(w.message) for w in caught),
        "kernel_local": list(lazy.dense.kernel.value.addressable_shards[0].data.shape),
        "losses": [float(v) for v in history.history["loss"]],
    }


def _run(case: str, tmp_path) -> dict:
    return run_case(__file__, case, tmp_path, timeout=500)


@pytest.fixture(autouse=True)
def _needs_keras():
    pytest.importorskip("keras")
    pytest.importorskip("tensorflow")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tf_distribute_api_and_unsupported_calls(tmp_path):
    out = _run("api", tmp_path)
    assert out["replicas"] == 8
    assert out["context"] == {"pipelines": 1, "id": 0, "per_replica": 8}
    assert out["same_batches"]  # per-replica batches joined = the global pipeline
    errors = out["errors"]
    assert (
        errors["per_replica"][0] == "BatchError"
        and "not divisible by num_replicas_in_sync 8" in errors["per_replica"][2]
    )
    assert errors["unbatched"][0] == "BridgeError" and "not batched" in errors["unbatched"][2]
    for name, hint in {
        "run": "model.fit",
        "reduce": "History",
        "gather": "np.asarray",
        "extended": "strategy.mesh",
    }.items():
        kind, not_implemented, message = errors[name]
        assert kind == "UnsupportedError" and not_implemented and hint in message, (name, errors[name])
    assert errors["missing"][0] == "AttributeError"
    assert errors["auto_tensor_mesh"][0] == "BridgeError" and "data x fsdp" in errors["auto_tensor_mesh"][2]
    assert errors["unknown_plan"][0] == "BridgeError" and "'auto'" in errors["unknown_plan"][2]
    assert out["tensor_mesh_replicas"] == 2  # the batch is split over data only
    assert errors["tape"] is not None and "GradientTape" in errors["tape"][2] and "train_step" in errors["tape"][2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resumed_fit_continues_from_its_data_position(tmp_path):
    import numpy as np

    out = _run("resume", tmp_path)
    straight = out["straight"]  # 20 batches: 2 epochs of 10
    assert len(straight) == 20 and len(out["crashed"]) == 7
    np.testing.assert_allclose(out["crashed"], straight[:7], atol=1e-5)
    step, data = out["restored"]
    assert step == 6 and data == {"epoch": 0, "position": 6, "seed": 0}
    # batches 6..9 of epoch 0, then epoch 1: 14 batches, each with the loss the uninterrupted run had there
    assert len(out["resumed"]) == 14, out["resumed"]
    np.testing.assert_allclose(out["resumed"], straight[6:], atol=1e-4)
    assert out["iterations"] == 20 and out["max_diff"] < 1e-5
    assert out["after_finished_restored"] == 20 and len(out["after_finished"]) == 20
    # .repeat() with steps_per_epoch=4, 4 epochs: step 6 is epoch 1's 2nd batch, the stream's 7th
    assert out["repeat_restored"] == {"epoch": 1, "position": 2, "seed": 0}
    assert len(out["repeat_straight"]) == 16 and len(out["repeat_resumed"]) == 10
    np.testing.assert_allclose(out["repeat_resumed"], out["repeat_straight"][6:], atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_time_based_saves(tmp_path):
    out = _run("saves", tmp_path)
    saved, good = out["seconds"]
    assert saved == [1, 2, 3, 4, 5, 6] and good == saved
    saved, good = out["minutes"]
    assert saved == [6] and good == [6]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_auto_plans_through_the_planner(tmp_path):
    out = _run("auto", tmp_path)
    tight, free = out["budget"], out["free"]
    assert tight["zero"] == 3 and tight["mesh"]["fsdp"] > 1, tight
    assert tight["kernel_local"] != [32, 4096] and "zero3" in tight["check"], tight
    assert any("memory budget: given" in n for n in tight["notes"])
    assert free["zero"] == 0 and free["kernel_local"] == [32, 4096], free
    assert tight["max_diff"] < 1e-5 and free["max_diff"] < 1e-5
    assert out["lazy"] is not None and "none were: build the model there" in out["lazy"]
    default, lazy = out["default"], out["default_lazy"]
    assert default["planned"] and default["zero"] == free["zero"] and default["max_diff"] < 1e-5
    assert lazy["warned"] and "built lazily" in lazy["fallback"]
    assert lazy["kernel_local"] in ([32 // 8, 4096], [32, 4096 // 8])  # the fsdp rule: split over the 8 devices
    assert lazy["losses"][1] < lazy["losses"][0]


if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import tensorflow as tf

    result = {}
    globals()["case_" + sys.argv[1]](keras, tf, result, sys.argv[2])
    print("RESULT " + json.dumps(result), flush=True)
