"""Tensors between JAX, PyTorch and TensorFlow through DLPack, zero-copy where the memory allows.

Zero-copy (the result shares the input's buffer) when the input lives on one device and has a DLPack dtype:
f16, bf16, f32, int8/16/32, uint8/16/32, bool, complex64 (and the 64-bit types when ``jax_enable_x64`` is on).
A torch tensor may be transposed / permuted (any dense stride order is zero-copy). Buffers not aligned to 64
bytes (a torch view at an offset, ``torch.from_numpy`` of a small numpy array) are copied by JAX itself.

Copies, by design and without a warning:
- torch tensors with gaps in their strides (``x[:, ::2]``) or the conj / neg bit set: made contiguous first;
- 64-bit inputs while ``jax_enable_x64`` is off: int64 / uint64 become int32 / uint32 after a range check (a
  value that does not fit raises ``BridgeError``), float64 / complex128 become float32 / complex64, as
  ``jnp.asarray`` would;
- a JAX array sharded over several devices: ``to_torch`` / ``to_tf`` gather it onto its first device. Use
  ``shards_to_torch`` / ``shards_to_tf`` for one zero-copy tensor per shard with its device instead, and
  ``shards_to_jax`` for the way back. A fully replicated array shares its first shard's buffer.

Not convertible (``BridgeError``): torch quantized / complex32 tensors, TF string / resource / variant
tensors, JAX int4 / float4 arrays, and float8 types the target lacks (TensorFlow has none through DLPack).

Example:
    >>> import torch, jax.numpy as jnp
    >>> a = jnp.arange(4.0)
    >>> t = to_torch(a)
    >>> t.data_ptr() == a.unsafe_buffer_pointer()
    True
    >>> to_jax(t).tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from openhosti_jax.errors import BridgeError
from openhosti_jax.sharding.batch import NARROW, check_narrowing

# DLPack dtypes TensorFlow's exporter handles; anything else aborts the process inside TF, so check first.
_TF_DLPACK_DTYPES = frozenset(
    "float16 bfloat16 float32 float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool".split()
    + ["complex64", "complex128"]
)


@dataclass(frozen=True)
class DeviceShard:
    """One addressable shard of a global ``jax.Array`` as a framework tensor.

    Attributes:
        device: the JAX device that holds the shard.
        index: the shard's slices into the global array (as ``jax.Shard.index``).
        tensor: the shard's data as a torch / TF tensor (zero-copy) or a ``jax.Array``.
    """

    device: jax.Device
    index: tuple[slice, ...]
    tensor: Any


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_tf(x: Any) -> bool:
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(x, tf.Tensor | tf.Variable)


def _dense_strides(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when ``strides`` are a permutation of a compact layout (no gaps, no broadcasting)."""
    dims = sorted((s, n) for n, s in zip(shape, strides, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def torch_to_numpy(t: Any) -> np.ndarray:
    """A CPU torch tensor as a numpy array sharing its memory (bf16 as ``ml_dtypes.bfloat16``).

    Tensors on an accelerator are copied to the host first; gradients are detached.

    Example:
        >>> import torch
        >>> torch_to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype.name
        'bfloat16'
    """
    import ml_dtypes
    import torch

    t = t.detach().cpu().resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return t.numpy()
    except TypeError as err:
        raise BridgeError(f"torch_to_numpy: numpy has no dtype for {t.dtype}; cast the tensor first") from err


def _torch_to_jax(x: Any, device: jax.Device | None) -> jax.Array:
    import torch

    if x.is_quantized or x.dtype == torch.complex32:
        raise BridgeError(f"to_jax: expected a tensor with a DLPack dtype, found {x.dtype}; dequantize first")
    x = x.detach()
    if x.is_conj() or x.is_neg():
        x = x.resolve_conj().resolve_neg()
    name = str(x.dtype).removeprefix("torch.")
    if name in NARROW and not jax.config.jax_enable_x64:
        if name in ("int64", "uint64") and x.numel():
            check_narrowing("to_jax", int(x.min()), int(x.max()), name, BridgeError)
        x = x.to(getattr(torch, NARROW[name]))
    if not _dense_strides(x.shape, x.stride()):
        x = x.contiguous()
    try:
        return jax.dlpack.from_dlpack(x, device=device)
    except (BufferError, RuntimeError, TypeError) as err:
        raise _dlpack_failure("to_jax", x.dtype, err) from err


def _tf_to_jax(x: Any, device: jax.Device | None) -> jax.Array:
    import tensorflow as tf

    if isinstance(x, tf.Variable):
        x = tf.convert_to_tensor(x)
    name = x.dtype.name
    if name not in _TF_DLPACK_DTYPES:
        raise BridgeError(
            f"to_jax: expected a TF tensor of a numeric or bool dtype, found {name}; "
            "convert strings with tf.strings ops to numbers first"
        )
    if name in NARROW and not jax.config.jax_enable_x64:
        if name in ("int64", "uint64") and tf.size(x) > 0:
            check_narrowing("to_jax", int(tf.reduce_min(x)), int(tf.reduce_max(x)), name, BridgeError)
        x = tf.cast(x, NARROW[name])
    try:
        return jax.dlpack.from_dlpack(x, device=device)
    except (BufferError, RuntimeError, TypeError) as err:
        raise _dlpack_failure("to_jax", x.dtype, err) from err


def to_jax(x: Any, *, device: jax.Device | None = None) -> jax.Array:
    """A torch or TF tensor as a single-device ``jax.Array``, sharing its memory where possible.

    Args:
        x: a ``torch.Tensor`` (any device DLPack knows, gradients detached) or a ``tf.Tensor``.
        device: the JAX device to place it on; default: the device matching the tensor's. A different
            device than the tensor's means a copy.

    Example:
        >>> import torch
        >>> to_jax(torch.ones(2, 3)).shape
        (2, 3)
    """
    if _is_torch(x):
        return _torch_to_jax(x, device)
    if _is_tf(x):
        return _tf_to_jax(x, device)
    raise BridgeError(
        f"to_jax: expected a torch.Tensor or tf.Tensor, found {type(x).__qualname__}; "
        "for numpy arrays use jnp.asarray or jax.device_put"
    )


def _single_device(a: Any, fn: str) -> jax.Array:
    """The array if on one device, its first shard if replicated, else a gathered copy on one device."""
    if not isinstance(a, jax.Array):
        raise BridgeError(f"{fn}: expected a jax.Array, found {type(a).__qualname__}; use to_jax for tensors")
    if a.is_deleted():
        raise BridgeError(f"{fn}: the jax.Array was deleted or donated; convert it before donating it")
    if len(a.sharding.device_set) == 1:
        return a
    if a.is_fully_replicated:
        return a.addressable_shards[0].data
    if not a.is_fully_addressable:
        raise BridgeError(
            f"{fn}: expected an array this process holds entirely, found one sharded over "
            f"{len(a.sharding.device_set)} devices of several processes; use shards_to_torch / shards_to_tf"
        )
    return jax.device_put(a, a.addressable_shards[0].device)


def _dlpack_failure(fn: str, dtype: Any, err: Exception) -> BridgeError:
    return BridgeError(
        f"{fn}: expected a dtype and device the target framework reads through DLPack, found {dtype} "
        f"({err}); cast first, e.g. a.astype(jnp.float32), or move it to a supported device"
    )


def to_torch(a: jax.Array) -> Any:
    """A ``jax.Array`` as a ``torch.Tensor`` sharing its buffer (sharded arrays: a gathered copy).

    Example:
        >>> import jax.numpy as jnp
        >>> to_torch(jnp.ones((2,), jnp.bfloat16)).dtype
        torch.bfloat16
    """
    import torch

    single = _single_device(a, "to_torch")
    try:
        return torch.from_dlpack(single)
    except (BufferError, RuntimeError, TypeError) as err:
        raise _dlpack_failure("to_torch", single.dtype, err) from err


def to_tf(a: jax.Array) -> Any:
    """A ``jax.Array`` as a ``tf.Tensor`` sharing its buffer (sharded arrays: a gathered copy).

    Example:
        >>> import jax.numpy as jnp
        >>> to_tf(jnp.arange(3)).numpy().tolist()
        [0, 1, 2]
    """
    import tensorflow as tf

    single = _single_device(a, "to_tf")
    if jnp.dtype(single.dtype).name not in _TF_DLPACK_DTYPES:
        raise _dlpack_failure("to_tf", single.dtype, ValueError("TensorFlow's DLPack lacks this dtype"))
    try:
        return tf.experimental.dlpack.from_dlpack(single.__dlpack__())
    except (BufferError, RuntimeError, TypeError) as err:
        raise _dlpack_failure("to_tf", single.dtype, err) from err


def _shards(a: jax.Array, convert: Any) -> list[DeviceShard]:
    if not isinstance(a, jax.Array):
        raise BridgeError(f"expected a jax.Array, found {type(a).__qualname__}")
    return [DeviceShard(s.device, s.index, convert(s.data)) for s in a.addressable_shards]


def shards_to_torch(a: jax.Array) -> list[DeviceShard]:
    """This process's shards of ``a``, each a zero-copy ``torch.Tensor`` with its device and index.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> a = jax.device_put(jnp.arange(16.0), jax.NamedSharding(mesh, jax.P("data")))
        >>> len(shards_to_torch(a)) == jax.device_count()
        True
    """
    return _shards(a, to_torch)


def shards_to_tf(a: jax.Array) -> list[DeviceShard]:
    """This process's shards of ``a``, each a zero-copy ``tf.Tensor`` with its device and index."""
    return _shards(a, to_tf)


def shards_to_jax(
    shards: Sequence[DeviceShard], sharding: jax.sharding.Sharding, global_shape: Sequence[int]
) -> jax.Array:
    """A global ``jax.Array`` from this process's per-device tensors (inverse of ``shards_to_torch``).

    Each tensor is placed on its shard's device; it shares memory when it already lives there (on CPU, only
    for the first device, since every torch / TF CPU tensor reports device 0).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> a = jax.device_put(jnp.arange(16.0), jax.NamedSharding(mesh, jax.P("data")))
        >>> b = shards_to_jax(shards_to_torch(a), a.sharding, a.shape)
        >>> bool((a == b).all())
        True
    """
    expected = sharding.addressable_devices
    found = {s.device for s in shards}
    if found != expected or len(shards) != len(expected):
        raise BridgeError(
            f"shards_to_jax: expected one shard per addressable device of the sharding ({len(expected)}), "
            f"found {len(shards)} on {len(found)} devices; pass every DeviceShard of this process"
        )
    arrays = [to_jax(s.tensor, device=s.device) for s in shards]
    return jax.make_array_from_single_device_arrays(tuple(global_shape), sharding, arrays)


__all__ = [
    "DeviceShard",
    "shards_to_jax",
    "shards_to_tf",
    "shards_to_torch",
    "to_jax",
    "to_tf",
    "to_torch",
    "torch_to_numpy",
]
