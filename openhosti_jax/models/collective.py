"""Collective matmuls: a sequence-parallel block's tensor-parallel projections with their collectives cut into
steps that each run beside a matmul, instead of one collective that the matmul waits for.

Under sequence parallelism (`openhosti_jax.sharding.ShardingPlan.sequence_parallel`) a block's input is split along
the sequence over the ``tensor`` axis. A column-parallel projection (query / key / value, MLP gate and up: output
features split over ``tensor``) needs the whole sequence, so it all-gathers its input first; a row-parallel one
(attention output, MLP down: input features split) gives each device a partial sum of the whole sequence, which a
reduce-scatter turns into the summed sequence split. The matmul and its collective depend on each other, so they
run one after the other (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in
Large Deep Learning Models", ASPLOS; Megatron-Core's ``--tp-comm-overlap``; the collective matmul of JAX's
``shard_map`` guide).

Here each is decomposed over the ``n`` devices of ``tensor``, inside `jax.shard_map`:

- `gathered_matmuls` (all-gather, then matmul): each device multiplies the sequence piece it holds while
  `jax.lax.ppermute` passes that piece to its ring neighbour; after ``n`` steps every device has multiplied every
  piece, and no step's matmul waits for a transfer other than the one that brought its own piece. One pass serves
  several kernels that read the same input (q, k and v; gate and up).
- `scattered_matmul` (matmul, then reduce-scatter): each device multiplies the piece of the sequence that is due
  next round the ring and adds the partial sum arriving from its neighbour, so after ``n`` steps each holds its own
  piece of the summed result.

The numbers equal the undecomposed projection's up to the order of the reduction's additions. Gradients come from
JAX's autodiff: the transpose of a ring of ``ppermute`` steps is the reverse ring, so the backward is decomposed
the same way. Outside a plan that asks for it (`collective_matmul_mesh` is None) both are plain matmuls.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.mesh import MeshConfig, build_mesh
    >>> mesh = build_mesh(MeshConfig.from_sizes({"data": 2, "tensor": 4}), jax.devices()[:8])
    >>> x = jax.random.normal(jax.random.key(0), (2, 16, 8))
    >>> w1, w2 = (jax.random.normal(jax.random.key(i), (8, 12)) for i in (1, 2))
    >>> with jax.set_mesh(mesh):
    ...     y1, y2 = jax.jit(lambda x, a, b: gathered_matmuls(x, (a, b), mesh, "data"))(x, w1, w2)
    ...     z = jax.jit(lambda y, w: scattered_matmul(y, w, mesh, "data"))(y1, w1.T)
    >>> bool(jnp.allclose(y1, x @ w1, atol=1e-5)), bool(jnp.allclose(z, (x @ w1) @ w1.T, atol=1e-4))
    (True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import ShardingError
from openhosti_jax.models.local import TENSOR_AXIS
from openhosti_jax.state.context import collective_matmul_mesh

__all__ = ["gathered_matmuls", "project_in", "project_out", "scattered_matmul"]


def _setup(mesh: Mesh, seq: int, context: str | None) -> tuple[int, set[str]]:
    """(tensor size, the axes made manual); a `ShardingError` where the mesh lacks ``tensor`` or the sequence
    does not divide over the axes that split it."""
    if TENSOR_AXIS not in mesh.axis_names:
        raise ShardingError(
            f"a collective matmul runs over the {TENSOR_AXIS!r} mesh axis; found axes {mesh.axis_names}; build the "
            "mesh with openhosti_jax.build_mesh(MeshConfig(tensor=...))"
        )
    sizes = dict(mesh.shape)
    n = int(sizes[TENSOR_AXIS])
    ways = n * int(sizes.get(context, 1)) if context else n
    if seq % ways:
        raise ShardingError(
            f"a collective matmul splits the sequence ({seq}) over {ways} devices "
            f"({f'{context} x ' if context else ''}{TENSOR_AXIS}), which does not divide it; use a sequence length "
            "they divide"
        )
    return n, {a for a in mesh.axis_names if a not in getattr(mesh, "manual_axes", ())}


def _call(fn: Any, mesh: Mesh, free: set[str], args: Sequence[jax.Array], in_specs: Any, out_specs: Any) -> Any:
    """``fn`` under `jax.shard_map` with ``free`` manual; on a mesh with explicit axes the inputs are placed as
    ``in_specs`` first and the outputs stay as ``out_specs`` say."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types[a] == AxisType.Explicit for a in free):
        args = [jax.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs, strict=True)]
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, axis_names=free)(*args)


def gathered_matmuls(
    x: jax.Array, kernels: Sequence[jax.Array], mesh: Mesh, rows: Any = None, context: str | None = None
) -> list[jax.Array]:
    """``[x @ w for w in kernels]`` for ``x`` ``(batch, seq, d)`` split along ``seq`` over ``tensor`` (inside
    ``context``'s split where given: over ``(context, tensor)``; its batch dim over ``rows``, a mesh axis or tuple
    of them, or None) and each ``w`` ``(d, f)`` split along ``f`` where ``tensor`` divides ``f``: each output
    ``(batch, seq, f)`` split along ``f`` (its sequence over ``context``). A kernel ``tensor`` does not divide
    (grouped-query key and value heads fewer than the devices) is whole on every device and multiplies only the
    device's own piece: its output is split along the sequence as ``x`` is. The all-gather of ``x`` is ``n - 1``
    ring hops, each beside the matmuls of the piece that arrived before it."""
    n, free = _setup(mesh, x.shape[1], context)
    split = [w.shape[1] % n == 0 for w in kernels]
    ring = [(j, (j - 1) % n) for j in range(n)]  # device j sends to j - 1, so it next holds piece j + t + 1

    def local(x: jax.Array, *ws: jax.Array) -> tuple[jax.Array, ...]:
        me = jax.lax.axis_index(TENSOR_AXIS)
        b, size = x.shape[:2]
        # split kernels: each step's product goes straight into its sequence slot (piece (me + t) mod n), so no
        # stacked copy of the steps is made; a whole kernel multiplies this device's own piece only
        outs = [jnp.zeros((b, n * size, w.shape[1]), x.dtype) if s else None for w, s in zip(ws, split, strict=True)]
        piece = x
        for t in range(n):
            nxt = jax.lax.ppermute(piece, TENSOR_AXIS, ring) if t < n - 1 else None  # in flight beside the matmuls
            for i, (w, s) in enumerate(zip(ws, split, strict=True)):
                if s:
                    y = jnp.einsum("bsd,df->bsf", piece, w)
                    outs[i] = jax.lax.dynamic_update_slice_in_dim(outs[i], y, ((me + t) % n) * size, axis=1)
                elif t == 0:
                    outs[i] = jnp.einsum("bsd,df->bsf", piece, w)
            piece = nxt
        return tuple(outs)

    seq = (context, TENSOR_AXIS) if context else TENSOR_AXIS
    in_specs = [P(rows, seq, None)] + [P(None, TENSOR_AXIS if s else None) for s in split]
    out_specs = tuple(P(rows, context, TENSOR_AXIS) if s else P(rows, seq, None) for s in split)
    return list(_call(local, mesh, free, [x, *kernels], in_specs, out_specs))


def scattered_matmul(
    h: jax.Array, kernel: jax.Array, mesh: Mesh, rows: Any = None, context: str | None = None
) -> jax.Array:
    """``h @ kernel`` for ``h`` ``(batch, seq, f)`` split along ``f`` over ``tensor`` (batch dim over ``rows``,
    sequence over ``context`` where given) and ``kernel`` ``(f, d)`` split along ``f``: the summed ``(batch, seq,
    d)`` split along ``seq`` over ``tensor`` (inside ``context``'s split). The reduce-scatter is ``n - 1`` ring hops
    of a partial sum, each beside the matmul of the piece it is added to."""
    n, free = _setup(mesh, h.shape[1], context)
    if kernel.shape[0] % n:
        raise ShardingError(
            f"a collective matmul splits a row-parallel kernel's input features ({kernel.shape[0]}) over the {n} "
            f"devices of {TENSOR_AXIS!r}, which does not divide them; use a tensor axis size dividing them"
        )
    ring = [(j, (j - 1) % n) for j in range(n)]

    def local(h: jax.Array, w: jax.Array) -> jax.Array:
        me, size = jax.lax.axis_index(TENSOR_AXIS), h.shape[1] // n

        def partial(t: int) -> jax.Array:  # step t adds piece (me + t + 1) mod n; the last is this device's own
            start = ((me + t + 1) % n) * size
            return jnp.einsum("bsf,fd->bsd", jax.lax.dynamic_slice_in_dim(h, start, size, axis=1), w)

        acc = partial(0)
        for t in range(1, n):
            acc = jax.lax.ppermute(acc, TENSOR_AXIS, ring) + partial(t)
        return acc

    seq = (context, TENSOR_AXIS) if context else TENSOR_AXIS
    specs = [P(rows, context, TENSOR_AXIS), P(TENSOR_AXIS, None)]
    return _call(local, mesh, free, [h, kernel], specs, P(rows, seq, None))


def _operands(linear: Any, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(x, kernel, bias or None) of an ``nnx.Linear``, cast to the dtype it computes in."""
    kernel = linear.kernel[...]
    dtype = linear.dtype or jnp.result_type(x, kernel)
    bias = None if getattr(linear, "bias", None) is None else linear.bias[...].astype(dtype)
    return x.astype(dtype), kernel.astype(dtype), bias


def _active(x: jax.Array) -> tuple[Mesh, Any, str | None, int] | None:
    """(mesh, batch axes, context axis, tensor size) where the step asks for collective matmuls and the axes split
    ``x``'s sequence (dim 1 of a rank-3 activation), else None."""
    active = collective_matmul_mesh()
    if active is None:
        return None
    mesh, rows, context = active
    sizes = dict(mesh.shape)
    n = int(sizes.get(TENSOR_AXIS, 1))
    ways = n * int(sizes.get(context, 1)) if context else n
    return (mesh, rows, context, n) if n > 1 and x.ndim == 3 and x.shape[1] % ways == 0 else None


def project_in(x: jax.Array, *linears: Any) -> list[jax.Array]:
    """``[linear(x) for linear in linears]`` (``nnx.Linear`` s reading the same input, outputs split over
    ``tensor``): under a plan that asks for collective matmuls (`collective_matmul_mesh`) and where its axes divide
    the sequence, one `gathered_matmuls` pass (biases added after it); else the plain projections."""
    active = _active(x)
    if active is None:
        return [lin(x) for lin in linears]
    mesh, rows, context, _ = active
    ops = [_operands(lin, x) for lin in linears]
    outs = gathered_matmuls(ops[0][0], [w for _, w, _ in ops], mesh, rows, context)
    return [y if b is None else y + b for y, (_, _, b) in zip(outs, ops, strict=True)]


def project_out(h: jax.Array, linear: Any) -> jax.Array:
    """``linear(h)`` (an ``nnx.Linear`` whose input is split over ``tensor``): under a plan that asks for
    collective matmuls and where its axes divide the sequence and ``tensor`` the input features, a
    `scattered_matmul` (the bias added after it); else the plain projection."""
    active = _active(h)
    if active is None or linear.in_features % active[3]:
        return linear(h)
    mesh, rows, context, _ = active
    h, w, b = _operands(linear, h)
    y = scattered_matmul(h, w, mesh, rows, context)
    return y if b is None else y + b
