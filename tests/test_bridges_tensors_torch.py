"""DLPack conversions between JAX and torch: values equal, zero-copy where promised, typed errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from openhosti_jax.bridges import (  # noqa: E402
    shards_to_jax,
    shards_to_torch,
    to_jax,
    to_torch,
)
from openhosti_jax.errors import BridgeError  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)

DTYPES = ["float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"]
SHAPES = [(), (0,), (3, 0), (5,), (4, 6), (2, 3, 8)]


def _reference(shape, dtype):
    """A numpy array with distinct values (mod the dtype) in the given shape."""
    n = int(np.prod(shape))
    raw = (np.arange(n) * 37 - 11).reshape(shape)
    if dtype == "bool":
        return np.asarray(raw % 3 == 0)
    if dtype in ("uint8",):
        return np.asarray(raw % 256, dtype=np.uint8)
    return np.asarray(raw, dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def _torch_from_numpy(x):
    """A torch-allocated (64-byte aligned) copy; ``torch.from_numpy`` keeps numpy's 16-byte alignment."""
    if x.dtype == ml_dtypes.bfloat16:
        return _torch_from_numpy(x.view(np.int16)).view(torch.bfloat16)
    src = torch.from_numpy(x.copy())
    return torch.empty(src.shape, dtype=src.dtype).copy_(src)


def _numpy_from_torch(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_to_jax_values_and_zero_copy(dtype, shape):
    ref = _reference(shape, dtype)
    t = _torch_from_numpy(ref)
    a = to_jax(t)
    expected_dtype = "int32" if dtype == "int64" else dtype  # jax_enable_x64 is off in the tests
    assert a.shape == shape and jnp.dtype(a.dtype).name == expected_dtype
    np.testing.assert_array_equal(np.asarray(a), ref.astype(a.dtype))
    if dtype != "int64" and ref.size:
        assert a.unsafe_buffer_pointer() == t.data_ptr()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "int64"])
def test_jax_to_torch_values_and_zero_copy(dtype, shape):
    ref = _reference(shape, dtype)
    a = jax.device_put(ref)
    t = to_torch(a)
    assert tuple(t.shape) == shape and str(t.dtype) == f"torch.{dtype}"
    np.testing.assert_array_equal(_numpy_from_torch(t), ref)
    if ref.size:
        assert t.data_ptr() == a.unsafe_buffer_pointer()


def test_int64_zero_copy_with_x64_and_range_checked_narrowing_without():
    big = torch.tensor([0, 2**40])
    with pytest.raises(BridgeError, match="fit int32"):
        to_jax(big)
    small = torch.tensor([-5, 7], dtype=torch.int64)
    np.testing.assert_array_equal(np.asarray(to_jax(small)), [-5, 7])
    with jax.enable_x64(True):
        a = to_jax(big)
        assert a.dtype == jnp.int64 and a.unsafe_buffer_pointer() == big.data_ptr()
        assert int(a[1]) == 2**40
        back = to_torch(a)
        assert back.dtype == torch.int64 and back.data_ptr() == big.data_ptr()


def test_float64_narrowed_like_jnp_asarray():
    t = torch.tensor([1.0 / 3.0, 2.5], dtype=torch.float64)
    a = to_jax(t)
    assert a.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(jnp.asarray(t.numpy())))


def test_permuted_is_zero_copy_strided_is_a_copy():
    base = torch.arange(24.0).reshape(2, 3, 4)
    perm = base.permute(2, 0, 1)
    a = to_jax(perm)
    np.testing.assert_array_equal(np.asarray(a), perm.numpy())
    assert a.unsafe_buffer_pointer() == perm.data_ptr()
    gaps = base[:, :, ::2]
    b = to_jax(gaps)
    np.testing.assert_array_equal(np.asarray(b), gaps.numpy())
    assert b.unsafe_buffer_pointer() != gaps.data_ptr()


def test_unaligned_offset_view_is_copied_by_jax():
    base = torch.arange(65.0)
    view = base[1:]
    a = to_jax(view)
    assert view.data_ptr() % 64 != 0 and a.unsafe_buffer_pointer() != view.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), view.numpy())


def test_requires_grad_conj_and_neg_views_convert():
    w = torch.arange(3.0, requires_grad=True)
    np.testing.assert_array_equal(np.asarray(to_jax(w)), [0.0, 1.0, 2.0])
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    np.testing.assert_array_equal(np.asarray(to_jax(z.conj())), np.conj(z.numpy()))
    np.testing.assert_array_equal(np.asarray(to_jax(torch._neg_view(w.detach()))), [-0.0, -1.0, -2.0])


def test_sharded_array_gathers_and_goes_shard_by_shard():
    mesh = jax.make_mesh((8,), ("data",))
    ref = np.arange(32.0, dtype=np.float32).reshape(16, 2)
    a = jax.device_put(ref, jax.NamedSharding(mesh, jax.P("data")))
    np.testing.assert_array_equal(to_torch(a).numpy(), ref)
    shards = shards_to_torch(a)
    assert [s.device for s in shards] == [s.device for s in a.addressable_shards]
    for s, js in zip(shards, a.addressable_shards, strict=True):
        assert s.tensor.data_ptr() == js.data.unsafe_buffer_pointer()
        np.testing.assert_array_equal(s.tensor.numpy(), ref[s.index])
    b = shards_to_jax(shards, a.sharding, a.shape)
    assert b.sharding == a.sharding
    np.testing.assert_array_equal(np.asarray(b), ref)
    replicated = jax.device_put(ref, jax.NamedSharding(mesh, jax.P()))
    t = to_torch(replicated)
    assert t.data_ptr() == replicated.addressable_shards[0].data.unsafe_buffer_pointer()


def test_typed_errors():
    with pytest.raises(BridgeError, match="expected a torch.Tensor or tf.Tensor"):
        to_jax(np.zeros(3))
    with pytest.raises(BridgeError, match="expected a jax.Array"):
        to_torch(np.zeros(3))
    with pytest.raises(BridgeError, match="int4"):
        to_torch(jnp.zeros(4, jnp.int4))
    deleted = jnp.ones(3)
    deleted.delete()
    with pytest.raises(BridgeError, match="deleted"):
        to_torch(deleted)
    mesh = jax.make_mesh((8,), ("data",))
    a = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.P("data")))
    with pytest.raises(BridgeError, match="one shard per addressable device"):
        shards_to_jax(shards_to_torch(a)[:3], a.sharding, a.shape)
