"""Mixed-precision policies, by name: the dtype parameters are stored in, the dtype the forward pass computes in,
the dtype of the outputs (logits, loss), and whether the optimizer keeps an fp32 master copy or scales the loss.

``"fp32"`` computes everything in float32; ``"bf16"`` stores float32 params and computes in bfloat16;
``"bf16_params"`` also stores the params in bfloat16, with an fp32 master copy and fp32 Adam moments in the
optimizer (`openhosti_jax.policies.optimizers.with_master_weights`); ``"fp16"`` computes in float16 with dynamic
loss scaling (`openhosti_jax.policies.optimizers.dynamic_loss_scale`); ``"fp8"`` is ``"bf16"`` with the repeated
blocks' linear layers multiplying in fp8, each operand scaled by its current maximum (`openhosti_jax.policies.fp8`;
NVIDIA GPUs from Ada and Hopper on, and CPU emulated).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.policies.precision import precision, state_bytes_per_param
    >>> p = precision("bf16")
    >>> tree = p.cast_to_compute({"w": jnp.ones((2, 2)), "step": jnp.int32(3)})
    >>> tree["w"].dtype, tree["step"].dtype
    (dtype(bfloat16), dtype('int32'))
    >>> p.cast_to_compute(jax.ShapeDtypeStruct((4,), jnp.float32))
    ShapeDtypeStruct(shape=(4,), dtype=bfloat16)
    >>> state_bytes_per_param(precision("bf16_params"), zero_stage=0, shards=1)
    14.0
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from openhosti_jax.errors import PlanningError


def _floating_dtype(value: Any, field: str) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise PlanningError(f"Precision.{field}: expected a floating dtype, found {value!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise PlanningError(f"Precision.{field}: expected a floating dtype, found {dtype}")
    return dtype


def _cast_tree(tree: Any, dtype: np.dtype) -> Any:
    """Casts the floating-point array leaves of ``tree`` to ``dtype``; every other leaf is returned unchanged."""

    def cast(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x.update(dtype=dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x
        return x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy.

    Attributes:
        name: the policy's name (a key of `PRECISIONS` for the built-in ones).
        param_dtype: the dtype the parameters are stored in.
        compute_dtype: the dtype the forward and backward passes compute in.
        output_dtype: the dtype of the model's outputs (logits, loss).
        master_weights: the optimizer keeps an fp32 master copy (and fp32 moments) because the params are stored
            in a low dtype.
        loss_scaling: gradients come from a dynamically scaled loss (needed for float16).
        fp8_matmuls: the repeated blocks' linear layers multiply in fp8 with current per-tensor scaling
            (`openhosti_jax.policies.fp8.fp8_dot_general`), the rest in ``compute_dtype``.

    Dtypes may be given as anything `numpy.dtype` accepts (``jnp.bfloat16``, ``"float32"``); they are stored as
    `numpy.dtype`. Only floating-point leaves are cast; integer, bool and non-array leaves pass through.
    """

    name: str
    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    master_weights: bool = False
    loss_scaling: bool = False
    fp8_matmuls: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanningError(f"Precision.name: expected a non-empty string, found {self.name!r}")
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _floating_dtype(getattr(self, field), field))
        for field in ("master_weights", "loss_scaling", "fp8_matmuls"):
            if not isinstance(getattr(self, field), bool):
                raise PlanningError(f"Precision.{field}: expected a bool, found {getattr(self, field)!r}")

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating-point leaves of ``tree`` (arrays or `jax.ShapeDtypeStruct`) to `compute_dtype`."""
        return _cast_tree(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating-point leaves of ``tree`` (arrays or `jax.ShapeDtypeStruct`) to `param_dtype`."""
        return _cast_tree(tree, self.param_dtype)

    def cast_output(self, tree: Any) -> Any:
        """Casts the floating-point leaves of ``tree`` (arrays or `jax.ShapeDtypeStruct`) to `output_dtype`."""
        return _cast_tree(tree, self.output_dtype)


_F32, _BF16, _F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)

PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", _F32, _F32, _F32),
    "bf16": Precision("bf16", _F32, _BF16, _F32),
    "bf16_params": Precision("bf16_params", _BF16, _BF16, _F32, master_weights=True),
    "fp16": Precision("fp16", _F32, _F16, _F32, loss_scaling=True),
    "fp8": Precision("fp8", _F32, _BF16, _F32, fp8_matmuls=True),
}
"""The built-in policies, by name."""


def precision(value: str | Precision) -> Precision:
    """Returns ``value`` if it is a `Precision`, else the built-in policy of that name (see `PRECISIONS`)."""
    if isinstance(value, Precision):
        return value
    if isinstance(value, str) and value in PRECISIONS:
        return PRECISIONS[value]
    raise PlanningError(f"unknown precision {value!r}; expected a Precision or one of {sorted(PRECISIONS)}")


def state_bytes_per_param(p: Precision, zero_stage: int, shards: int, moments: int = 2) -> float:
    """Per-device bytes of parameters + fp32 master copy + optimizer moments, per parameter (the ZeRO formula).

    A parameter takes ``param_dtype.itemsize`` bytes; with master weights the optimizer adds a 4-byte fp32 copy
    and keeps its ``moments`` moments in fp32 (4 bytes each), otherwise the moments take the param dtype. ZeRO
    stage 0 divides nothing; stages 1 and 2 divide the master copy and the moments by ``shards`` (stage 2 also
    shards gradients, which are not state); stage 3 divides the parameters too. Gradients and activations are
    not counted.

    Example (Adam, 2 moments): bf16 params with an fp32 master copy take 2 + 4 + 8 = 14 bytes at stage 0, plain
    fp32 Adam 4 + 8 = 12; at stage 3 over 4 shards, 14 / 4:

        >>> from openhosti_jax.policies.precision import PRECISIONS, state_bytes_per_param
        >>> state_bytes_per_param(PRECISIONS["bf16_params"], zero_stage=0, shards=1)
        14.0
        >>> state_bytes_per_param(PRECISIONS["fp32"], zero_stage=0, shards=1)
        12.0
        >>> state_bytes_per_param(PRECISIONS["bf16_params"], zero_stage=1, shards=4)
        5.0
        >>> state_bytes_per_param(PRECISIONS["bf16_params"], zero_stage=3, shards=4)
        3.5
    """
    if not isinstance(p, Precision):
        raise PlanningError(f"state_bytes_per_param: expected a Precision, found {type(p).__name__}")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise PlanningError(f"state_bytes_per_param: zero_stage must be 0, 1, 2 or 3, found {zero_stage!r}")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise PlanningError(f"state_bytes_per_param: shards must be an int >= 1, found {shards!r}")
    if isinstance(moments, bool) or not isinstance(moments, int) or moments < 0:
        raise PlanningError(f"state_bytes_per_param: moments must be an int >= 0, found {moments!r}")
    param = float(p.param_dtype.itemsize)
    master = 4.0 if p.master_weights else 0.0
    moment = 4.0 if p.master_weights else float(p.param_dtype.itemsize)
    optimizer = master + moments * moment
    if zero_stage == 0:
        return param + optimizer
    if zero_stage in (1, 2):
        return param + optimizer / shards
    return (param + optimizer) / shards


__all__ = ["Precision", "PRECISIONS", "precision", "state_bytes_per_param"]
