"""`wrap_for_tf`: a JAX function as a differentiable TensorFlow op that ``tf.function`` code can consume.

The call runs through ``tf.py_function`` (eager Python inside a TF graph), its gradient through
``tf.custom_gradient``; tensors cross through DLPack. Output shapes and dtypes come from ``jax.eval_shape`` at
trace time, so the result has a static shape downstream TF ops can use; inputs need fully known shapes. The
backward pass recomputes the forward inside one jitted VJP (TF cannot carry JAX residuals between the two
``py_function`` calls). Integer inputs get no gradient.

Example:
    >>> import tensorflow as tf, jax.numpy as jnp
    >>> f = wrap_for_tf(lambda x: jnp.sin(x) * 2)
    >>> @tf.function
    ... def g(x):
    ...     return tf.reduce_sum(f(x))
    >>> round(float(g(tf.zeros(3))), 3)
    0.0
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from openhosti_jax.bridges.tensors import to_jax, to_tf
from openhosti_jax.errors import BridgeError


def wrap_for_tf(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(*jax arrays) -> array | tuple of arrays`` as a TF function of tensors with a gradient.

    Other output pytrees come back as the flat tuple of their leaves.
    """
    import tensorflow as tf

    fwd = jax.jit(lambda *args: jax.tree.leaves(fn(*args)))

    @jax.jit
    def bwd(args: tuple[jax.Array, ...], cts: list[jax.Array]) -> tuple[Any, ...]:
        mask = [jnp.issubdtype(a.dtype, jnp.inexact) for a in args]

        def of_diff(*diff: jax.Array) -> list[jax.Array]:
            it = iter(diff)
            return jax.tree.leaves(fn(*[next(it) if m else a for m, a in zip(mask, args, strict=True)]))

        _, vjp = jax.vjp(of_diff, *[a for m, a in zip(mask, args, strict=True) if m])
        return vjp(cts)

    def avals(xs: tuple[Any, ...]) -> list[jax.ShapeDtypeStruct]:
        unknown = [i for i, x in enumerate(xs) if not x.shape.is_fully_defined()]
        if unknown:
            raise BridgeError(
                f"wrap_for_tf: expected inputs with fully known shapes, found unknown dims at positions {unknown} "
                f"({[xs[i].shape for i in unknown]}); give tf.function an input_signature with static shapes"
            )
        specs = [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype.as_numpy_dtype) for x in xs]
        return jax.tree.leaves(jax.eval_shape(fn, *specs))

    @tf.custom_gradient
    def call(*xs: Any) -> Any:
        xs = tuple(tf.convert_to_tensor(x) for x in xs)
        outs_aval = avals(xs)
        outs = tf.py_function(
            lambda *e: [to_tf(o) for o in fwd(*[to_jax(t) for t in e])],
            xs,
            [tf.as_dtype(o.dtype) for o in outs_aval],
        )
        for o, aval in zip(outs, outs_aval, strict=True):
            o.set_shape(aval.shape)

        def grad(*upstream: Any) -> list[Any]:
            diff = [x for x in xs if x.dtype.is_floating or x.dtype.is_complex]

            def run(*e: Any) -> list[Any]:
                arrays = [to_jax(t) for t in e]
                args, cts = tuple(arrays[: len(xs)]), arrays[len(xs) :]
                cts = [c.astype(a.dtype) for c, a in zip(cts, outs_aval, strict=True)]
                return [to_tf(g) for g in bwd(args, cts)]

            grads = tf.py_function(run, [*xs, *upstream], [x.dtype for x in diff]) if diff else []
            it = iter(grads)
            result = []
            for x in xs:
                if x.dtype.is_floating or x.dtype.is_complex:
                    g = next(it)
                    g.set_shape(x.shape)
                    result.append(g)
                else:
                    result.append(None)
            return result

        return (outs[0] if len(outs) == 1 else tuple(outs)), grad

    return functools.wraps(fn)(call)


__all__ = ["wrap_for_tf"]
