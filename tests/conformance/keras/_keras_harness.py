"""Runs a Keras example as keras.io writes it twice in one fresh process: first on plain Keras on one device, then
with its strategy line made ``openhosti_jax.frontends.keras.Strategy()`` (8 simulated devices), and returns both
results.

The example is a function ``example(make_strategy, workdir) -> dict`` whose first line is
``strategy = make_strategy()``, the one line tf.distribute code changes. The one-device run's strategy is
`OneDevice`: tf.distribute's default strategy (a scope that does nothing, datasets as given) with the mesh's
replica count, so both runs train on the same global batches. Keras fixes its backend at its first import, hence
the process (the example's test file is the worker)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
REPLICAS = 8


class OneDevice:
    """Plain Keras with tf.distribute's strategy surface, as ``tf.distribute.get_strategy()`` offers it."""

    num_replicas_in_sync = REPLICAS

    def scope(self):
        return contextlib.nullcontext(self)

    def experimental_distribute_dataset(self, dataset, options=None):
        return dataset

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        import tensorflow as tf

        asked = []

        class Context(tf.distribute.InputContext):
            def get_per_replica_batch_size(self, global_batch_size):
                asked.append(super().get_per_replica_batch_size(global_batch_size))
                return asked[-1]

        dataset = dataset_fn(Context(1, 0, REPLICAS))
        return dataset.rebatch(asked[-1] * REPLICAS)  # tf.distribute feeds the replicas' batches in turn


def worker(example) -> None:
    """The worker's main: run ``example`` on one device, then on the strategy, print both as JSON."""
    os.environ["KERAS_BACKEND"] = "jax"
    import keras

    workdir = sys.argv[1]
    out = {}
    keras.utils.set_random_seed(0)
    out["single"] = example(OneDevice, os.path.join(workdir, "single"))
    from openhosti_jax.frontends.keras import Strategy

    keras.utils.set_random_seed(0)
    out["mesh"] = example(Strategy, os.path.join(workdir, "mesh"))
    print("RESULT " + json.dumps(out), flush=True)


def run(test_file: str, tmp_path) -> dict:
    """Both runs' results of the example in ``test_file`` (a fresh process on 8 simulated CPU devices)."""
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": ROOT + os.pathsep + os.path.dirname(os.path.abspath(__file__)),
    }
    cmd = [sys.executable, os.path.abspath(test_file), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(line[7:])


def weights(model) -> list:
    """Every variable of ``model`` (trainable and not) as nested lists."""
    return [np.asarray(w).tolist() for w in model.get_weights()]


def assert_same(single: dict, mesh: dict, keys, atol: float = 1e-4) -> None:
    """``single`` and ``mesh`` agree within ``atol`` at each of ``keys``: numbers, arrays, lists of arrays of
    different shapes (weights) or dicts of them (a History)."""

    def close(a, b, where):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                close(a[k], b[k], f"{where}/{k}")
            return
        try:
            x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        except ValueError:  # ragged: one array per element
            assert len(a) == len(b), where
            for i, (p, q) in enumerate(zip(a, b, strict=True)):
                close(p, q, f"{where}[{i}]")
            return
        np.testing.assert_allclose(y, x, atol=atol, err_msg=where)

    for key in keys:
        close(single[key], mesh[key], key)


def blobs(n: int, shape: tuple[int, ...], classes: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` synthetic examples of ``shape``: class k is a fixed random pattern k plus noise (learnable, not
    trivially)."""
    rs = np.random.RandomState(seed)
    patterns = np.random.RandomState(1234).rand(classes, *shape).astype("float32")
    if len(shape) == 3:  # images: 4x4 blocks, so that convolutions and pooling see the pattern
        blocks = np.random.RandomState(1234).rand(classes, shape[0] // 4, shape[1] // 4, shape[2])
        patterns = np.kron(blocks, np.ones((1, 4, 4, 1))).astype("float32")
    y = rs.randint(0, classes, n)
    x = (3.0 * patterns[y] + rs.rand(n, *shape)).astype("float32")
    return x, y
