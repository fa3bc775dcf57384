"""TensorFlow bridges in one module (TF is imported once): tensors, tf.data loader, JAX ops inside tf.function."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)  # leave the cores to JAX
tf.config.threading.set_inter_op_parallelism_threads(1)

from openhosti_jax.bridges import (  # noqa: E402
    TFDatasetLoader,
    shards_to_jax,
    shards_to_tf,
    to_jax,
    to_tf,
    wrap_for_tf,
)
from openhosti_jax.errors import BatchError, BridgeError  # noqa: E402

pytestmark = pytest.mark.tf

DTYPES = ["float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"]
SHAPES = [(), (0,), (3, 0), (5,), (4, 6)]


class _Capsule:
    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **_):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def _tf_ptr(t):
    """The address of a CPU TF tensor's buffer (read through its DLPack export)."""
    return np.from_dlpack(_Capsule(tf.experimental.dlpack.to_dlpack(t))).__array_interface__["data"][0]


def _reference(shape, dtype):
    raw = (np.arange(int(np.prod(shape))) * 37 - 11).reshape(shape)
    if dtype == "bool":
        return np.asarray(raw % 3 == 0)
    if dtype == "uint8":
        return np.asarray(raw % 256, dtype=np.uint8)
    return np.asarray(raw, dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_both_directions_values_and_zero_copy(dtype, shape):
    ref = _reference(shape, dtype)
    t = tf.constant(ref)
    a = to_jax(t)
    assert jnp.dtype(a.dtype).name == ("int32" if dtype == "int64" else dtype)
    np.testing.assert_array_equal(np.asarray(a), ref.astype(a.dtype))
    if dtype == "int64":
        return  # narrowed to int32 (jax_enable_x64 is off): a copy by design
    back = to_tf(a)
    assert back.dtype.name == dtype and tuple(back.shape) == shape
    np.testing.assert_array_equal(back.numpy(), ref)
    if ref.size:
        assert to_jax(back).unsafe_buffer_pointer() == a.unsafe_buffer_pointer()  # both ways shared
        if dtype != "bfloat16":  # numpy reads no bf16 DLPack, so no direct TF address for it
            assert a.unsafe_buffer_pointer() == _tf_ptr(t)
            assert _tf_ptr(back) == a.unsafe_buffer_pointer()


def test_int64_range_check_x64_and_errors():
    with pytest.raises(BridgeError, match="fit int32"):
        to_jax(tf.constant([2**40], tf.int64))
    with jax.enable_x64(True):
        t = tf.constant([2**40, -3], tf.int64)
        a = to_jax(t)
        assert a.dtype == jnp.int64 and a.unsafe_buffer_pointer() == _tf_ptr(t)
    with pytest.raises(BridgeError, match="found string"):
        to_jax(tf.constant(["a"]))
    with pytest.raises(BridgeError, match="float8_e4m3fn"):
        to_tf(jnp.zeros(3, jnp.float8_e4m3fn))


def test_sharded_array_shard_by_shard():
    mesh = jax.make_mesh((8,), ("data",))
    ref = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    a = jax.device_put(ref, jax.NamedSharding(mesh, jax.P("data")))
    np.testing.assert_array_equal(to_tf(a).numpy(), ref)
    shards = shards_to_tf(a)
    for s, js in zip(shards, a.addressable_shards, strict=True):
        assert _tf_ptr(s.tensor) == js.data.unsafe_buffer_pointer()
        np.testing.assert_array_equal(s.tensor.numpy(), ref[s.index])
    np.testing.assert_array_equal(np.asarray(shards_to_jax(shards, a.sharding, a.shape)), ref)


X = np.random.default_rng(0).normal(size=(24, 3)).astype(np.float32)
Y = np.arange(24, dtype=np.int64)


def _make(epoch, seed):
    ds = tf.data.Dataset.from_tensor_slices({"x": X, "y": Y}).shuffle(24, seed=seed + epoch).batch(4)
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    return ds.with_options(options)


def test_tf_data_batches_resume_and_global_batches():
    ref = [next(it) for it in [TFDatasetLoader(_make, seed=5)] for _ in range(9)]  # 6 per epoch
    for epoch in (ref[:6], ref[6:]):
        ys = np.concatenate([b["y"] for b in epoch])
        assert len(ys) == len(set(ys.tolist()))
        for b in epoch:
            np.testing.assert_array_equal(b["x"], X[b["y"]])
    assert not np.array_equal(np.concatenate([b["y"] for b in ref[:3]]), np.concatenate([b["y"] for b in ref[6:9]]))
    for cut in (2, 6, 7):
        first = TFDatasetLoader(_make, seed=5)
        for _ in range(cut):
            next(first)
        resumed = TFDatasetLoader(_make, seed=0)
        resumed.set_state(json.loads(json.dumps(first.get_state())))
        for want in ref[cut:]:
            np.testing.assert_array_equal(next(resumed)["y"], want["y"])
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    plain = TFDatasetLoader(tf.data.Dataset.from_tensor_slices((X, Y)).batch(8), names=("x", "y"), mesh=mesh)
    g = next(plain)
    assert g["x"].sharding.spec == jax.P("data") and g["y"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(g["x"]), X[:8])
    bad = TFDatasetLoader(_make)
    bad.set_state({"epoch": 0, "position": 50, "seed": 0})
    with pytest.raises(BatchError, match="has only 6"):
        next(bad)
    with pytest.raises(BatchError, match="needs names"):
        next(TFDatasetLoader(tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)))


def _tf_layer(x, w):
    return tf.tanh(tf.matmul(x, w)) ** 2, tf.reduce_sum(tf.sin(x), axis=1)


def test_jax_op_inside_tf_function_gradients_equal_tf():
    f = wrap_for_tf(lambda x, w: (jnp.tanh(x @ w) ** 2, jnp.sum(jnp.sin(x), axis=1)))
    rng = np.random.default_rng(2)
    x0, w0 = rng.normal(size=(5, 4)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)

    def make_step(layer):
        @tf.function
        def step(x, w):
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                y, z = layer(x, w)
                assert y.shape == (5, 3) and z.shape == (5,)  # static shapes reach the graph
                loss = tf.reduce_mean(y) + tf.reduce_sum(z**2)
            return loss, tape.gradient(loss, [x, w])

        return step

    got = make_step(f)(tf.constant(x0), tf.constant(w0))
    want = make_step(_tf_layer)(tf.constant(x0), tf.constant(w0))
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def test_tf_training_loop_with_a_jax_op_matches_pure_tf():
    f = wrap_for_tf(lambda x, w, idx: jnp.tanh(x @ w)[idx])
    rng = np.random.default_rng(3)
    xs, ys = rng.normal(size=(3, 8, 4)).astype(np.float32), rng.normal(size=(3, 6, 2)).astype(np.float32)
    idx = tf.constant([0, 1, 2, 3, 5, 7])
    w0 = rng.normal(size=(4, 2)).astype(np.float32)

    def train(layer):
        w = tf.Variable(w0)
        opt = tf.keras.optimizers.SGD(0.1)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((layer(x, w, idx) - y) ** 2)
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            return loss

        return [float(step(x, y)) for x, y in zip(xs, ys, strict=True)], w.numpy()

    got_losses, got_w = train(f)
    want_losses, want_w = train(lambda x, w, i: tf.gather(tf.tanh(x @ w), i))
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(BridgeError, match="fully known shapes"):
        tf.function(f, input_signature=[tf.TensorSpec([None, 4]), tf.TensorSpec([4, 2]), tf.TensorSpec([6], tf.int32)])(
            xs[0], w0, idx
        )
