"""`wrap_for_torch`: a (sharded, jitted) JAX function as a ``torch.autograd.Function``.

A torch training loop calls the wrapped function on tensors and gets tensors back; ``loss.backward()`` runs the
JAX VJP. The forward pass and the backward pass are each one compiled XLA call (``jax.vjp`` under ``jax.jit``,
its residuals kept between the two). Inputs and outputs cross through DLPack (zero-copy on one device). Integer
and bool inputs are not differentiated (their gradient is ``None``); integer outputs are marked
non-differentiable.

Example:
    >>> import torch, jax.numpy as jnp
    >>> f = wrap_for_torch(lambda x, w: jnp.tanh(x @ w))
    >>> x, w = torch.ones(2, 3), torch.ones(3, 1, requires_grad=True)
    >>> f(x, w).sum().backward()
    >>> tuple(w.grad.shape)
    (3, 1)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from openhosti_jax.bridges.tensors import to_jax, to_torch
from openhosti_jax.errors import BridgeError


def _differentiable(a: jax.Array) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _make_fwd_bwd(fn: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Jitted ``fwd(mask, *args) -> (out, vjp)`` differentiating the args where ``mask`` is True, and ``bwd``."""

    @functools.partial(jax.jit, static_argnums=0)
    def fwd(mask: tuple[bool, ...], *args: jax.Array) -> tuple[Any, Any]:
        fixed = [None if m else a for m, a in zip(mask, args, strict=True)]

        def of_diff(*diff: jax.Array) -> Any:
            it = iter(diff)
            return fn(*[next(it) if m else f for m, f in zip(mask, fixed, strict=True)])

        return jax.vjp(of_diff, *[a for m, a in zip(mask, args, strict=True) if m])

    bwd = jax.jit(lambda vjp, cotangent: vjp(cotangent))
    return fwd, bwd


def wrap_for_torch(
    fn: Callable[..., Any], *, in_shardings: Sequence[jax.sharding.Sharding | None] | None = None
) -> Callable[..., Any]:
    """``fn(*jax arrays) -> array | tuple of arrays`` as a differentiable torch function of tensors.

    Other output pytrees come back as the flat tuple of their leaves.

    Args:
        fn: a JAX function (jitted or not; it is jitted here) of positional arrays.
        in_shardings: optional, one per argument: place that input with this sharding before the call (e.g. a
            ``NamedSharding`` over a mesh to run ``fn`` data-parallel); ``None`` replicates it over that
            mesh (over the first ``NamedSharding``'s mesh; on one device if there is none).
            Sharded outputs and gradients come back to torch as gathered copies.
    """
    import torch

    fwd, bwd = _make_fwd_bwd(fn)

    def place(args: Sequence[jax.Array]) -> list[jax.Array]:
        if in_shardings is None:
            return list(args)
        if len(in_shardings) != len(args):
            raise BridgeError(
                f"wrap_for_torch: expected {len(in_shardings)} inputs (one per in_shardings entry), found {len(args)}"
            )
        meshes = [s.mesh for s in in_shardings if isinstance(s, jax.NamedSharding)]
        fill = jax.NamedSharding(meshes[0], jax.P()) if meshes else None
        return [
            a if (s or fill) is None else jax.device_put(a, s or fill) for a, s in zip(args, in_shardings, strict=True)
        ]

    class JaxFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *tensors: Any) -> Any:
            bad = [i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)]
            if bad:
                raise BridgeError(f"wrap_for_torch: expected torch tensors, found other values at positions {bad}")
            args = place([to_jax(t) for t in tensors])
            mask = tuple(_differentiable(a) for a in args)
            out, vjp = fwd(mask, *args)
            leaves, treedef = jax.tree.flatten(out)
            ctx.jax_state = (mask, vjp, treedef, [(a.shape, a.dtype, a.sharding) for a in leaves])
            results = [to_torch(a) for a in leaves]
            ctx.mark_non_differentiable(*[r for r, a in zip(results, leaves, strict=True) if not _differentiable(a)])
            return results[0] if jax.tree_util.treedef_is_leaf(treedef) else tuple(results)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            mask, vjp, treedef, avals = ctx.jax_state
            cts = [
                jax.device_put(to_jax(g).astype(dt), sharding)
                if jnp.issubdtype(dt, jnp.inexact)
                else np.zeros(shape, jax.dtypes.float0)
                for g, (shape, dt, sharding) in zip(grads, avals, strict=True)
            ]
            diff_grads = iter(bwd(vjp, jax.tree.unflatten(treedef, cts)))
            return tuple(to_torch(next(diff_grads)) if m else None for m in mask)

    def call(*tensors: Any) -> Any:
        return JaxFunction.apply(*tensors)

    return functools.wraps(fn)(call)


__all__ = ["wrap_for_torch"]
