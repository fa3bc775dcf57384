"""fp8 matmuls with current per-tensor scaling: what precision ``"fp8"`` (`openhosti_jax.policies.precision`) runs in
the repeated blocks' linear layers, the parameters kept in float32 and everything else in bfloat16.

`fp8_dot_general` is a drop-in ``dot_general`` (the argument ``nnx.Linear`` takes). Each operand is scaled by its
own current absolute maximum into the fp8 range and rounded (`quantize`): the forward's inputs and weights to
``float8_e4m3fn`` (more resolution), the backward's output gradient to ``float8_e5m2`` (more range), the usual split
(JAX-Toolbox's ``docs/NATIVE_FP8.md``; Micikevicius et al. 2022, "FP8 Formats for Deep Learning"). Each matmul
then reads its operands dequantized, ``convert(f8) * scale -> dot``: the pattern XLA's GPU compiler rewrites into
one cuBLASLt fp8 matmul with the two scales (Hopper and later), and which XLA on CPU computes as the rounded values'
matmul (fp8 emulated, for tests). Scaling by the current tensor's maximum (not a delayed amax history, as Flax's
``Fp8DotGeneralOp`` does) needs no state between steps; the backward keeps the fp8 operands, half the bytes of
bf16 ones.

Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.array([[896.0, -3.0], [0.5, 2.0]], jnp.bfloat16)
    >>> q, scale = quantize(x, jnp.float8_e4m3fn)  # max |x| onto e4m3's largest, 448
    >>> q.dtype, float(scale), bool(jnp.all(dequantize(q, scale) == x))  # these values are exact in e4m3
    (dtype(float8_e4m3fn), 2.0, True)
    >>> w = jax.random.normal(jax.random.key(0), (2, 3), jnp.bfloat16)
    >>> dims = (((1,), (0,)), ((), ()))
    >>> bool(jnp.allclose(fp8_dot_general(x, w, dims), x @ w, rtol=0.1, atol=0.1))
    True
    >>> fp8_problem("tpu", "TPU v5p")[:33]
    "precision='fp8' runs its matmuls "
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORWARD = jnp.float8_e4m3fn
"""The fp8 format of the forward's operands."""

BACKWARD = jnp.float8_e5m2
"""The fp8 format of the output gradient."""

MIN_COMPUTE_CAPABILITY = (8, 9)
"""NVIDIA GPUs with fp8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0 and later)."""

BACKENDS = "NVIDIA GPUs of compute capability 8.9 or later (L4, L40S, H100, H200, B200, GB200) and CPU (emulated)"
"""Where precision ``"fp8"`` runs."""


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)``: ``x`` divided by ``scale = max|x| / max(dtype)`` (1 for an all-zero ``x``; the scale in
    ``x``'s dtype, so the dequantization `dequantize` is the pattern XLA matches) and rounded to the fp8 ``dtype``,
    clipped to its range."""
    top = float(jnp.finfo(dtype).max)
    amax = jax.lax.stop_gradient(jnp.max(jnp.abs(x)).astype(jnp.float32))
    scale = jnp.where(amax > 0, amax / top, 1.0).astype(x.dtype)
    q = jnp.clip(x.astype(jnp.float32) / scale.astype(jnp.float32), -top, top).astype(dtype)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q`` in ``scale``'s dtype, times ``scale``."""
    return q.astype(scale.dtype) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dot(lhs: jax.Array, rhs: jax.Array, dims: Any, out_dtype: Any) -> jax.Array:
    return _fwd(lhs, rhs, dims, out_dtype)[0]


def _fwd(lhs: jax.Array, rhs: jax.Array, dims: Any, out_dtype: Any) -> tuple[jax.Array, tuple]:
    (ql, sl), (qr, sr) = quantize(lhs, FORWARD), quantize(rhs, FORWARD)
    out = jax.lax.dot_general(dequantize(ql, sl), dequantize(qr, sr), dims, preferred_element_type=out_dtype)
    return out, (ql, sl, qr, sr)


def _bwd(dims: Any, out_dtype: Any, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    ql, sl, qr, sr = res
    qg, sg = quantize(g.astype(sl.dtype), BACKWARD)

    def dot(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)

    _, vjp = jax.vjp(dot, dequantize(ql, sl), dequantize(qr, sr))
    da, db = vjp(dequantize(qg, sg).astype(out_dtype))
    return da.astype(sl.dtype), db.astype(sr.dtype)


_dot.defvjp(_fwd, _bwd)


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """`jax.lax.dot_general` of ``lhs`` and ``rhs`` with both in fp8 (`FORWARD`, each scaled by its current
    maximum) and the output gradient in fp8 (`BACKWARD`) in the backward; the result in ``preferred_element_type``
    (default: ``lhs``'s dtype). ``precision`` and any other keyword (``out_sharding``) are accepted for the
    signature ``nnx.Linear`` calls and unused."""
    del precision, kwargs
    dims = tuple(tuple(tuple(int(i) for i in side) for side in part) for part in dimension_numbers)
    out = np.dtype(preferred_element_type or lhs.dtype)
    return _dot(lhs, rhs.astype(lhs.dtype), dims, out)


def fp8_problem(platform: str, kind: str = "", compute_capability: str | None = None) -> str | None:
    """Why precision ``"fp8"`` cannot run on a device of ``platform`` (``kind``, CUDA ``compute_capability`` such
    as ``"9.0"``); None where it can (`BACKENDS`)."""
    if platform == "cpu":
        return None
    if platform == "gpu" and compute_capability:
        major, minor = (int(x) for x in compute_capability.split(".")[:2])
        if (major, minor) >= MIN_COMPUTE_CAPABILITY:
            return None
    found = f"{platform} ({kind}" + (f", compute capability {compute_capability}" if compute_capability else "") + ")"
    return (
        f"precision='fp8' runs its matmuls in fp8 on {BACKENDS}; found {found}. Use precision='bf16', or run on "
        "one of those"
    )


def device_fp8_problem(device: jax.Device) -> str | None:
    """`fp8_problem` for ``device``."""
    return fp8_problem(str(device.platform), str(device.device_kind), getattr(device, "compute_capability", None))


__all__ = ["BACKENDS", "dequantize", "device_fp8_problem", "fp8_dot_general", "fp8_problem", "quantize"]
