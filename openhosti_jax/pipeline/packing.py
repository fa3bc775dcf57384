"""How a pipeline's chunks of layers hold their parameters: one padded ``(V, S, N)`` buffer, row ``(v, d)`` the
parameters of chunk ``v * S + d``, so stages with different parameter structures share one array sharded over the
mesh's ``stage`` axis.

With a ``tensor`` axis of size ``T`` a row is ``T`` equal slots, slot ``t`` holding tensor rank ``t``'s part of every
leaf: the ``t``-th block of a leaf split along its tensor-parallel dim (the dim its `PartitionSpec` puts on
``tensor``, Megatron's column or row split), and the ``t``-th piece of any other leaf flattened. Sharding the last
dim over ``tensor`` then gives each rank its own blocks, and `Packing.chunk_params` rebuilds the leaves from the
slots with the split dims sharded over ``tensor``, so XLA partitions the stage's layers over it. With ``T = 1`` a
row is the chunk's leaves flattened one after the other (`jax.flatten_util.ravel_pytree`'s order).

Example:
    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from openhosti_jax.pipeline import LayerCost, evaluate_partition, gpipe
    >>> cut = evaluate_partition([LayerCost(1, 1, 1, 1, 1, 1)] * 2, (0, 1, 2), 2)
    >>> params = [{"w": jnp.arange(8.0).reshape(2, 4)}, {"w": jnp.ones((4, 2))}]
    >>> specs = [{"w": P(None, "tensor")}, {"w": P("tensor", None)}]
    >>> packing = Packing(params, cut, gpipe(2, 2), tensor=2, tensor_specs=specs)
    >>> packed = packing.pack(params)
    >>> packed.shape, packed[0, 0].tolist()  # slot 0: columns 0-1 of w, slot 1: columns 2-3
    ((1, 2, 8), [0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0])
    >>> bool((packing.unpack(packed)[0]["w"] == params[0]["w"]).all())
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PipelineError
from openhosti_jax.pipeline.partitioner import StagePartition
from openhosti_jax.pipeline.schedule import Schedule
from openhosti_jax.pipeline.tensor import TENSOR, tensor_dim
from openhosti_jax.sharding.specs import is_spec


class _Leaf(NamedTuple):
    """Where one parameter leaf sits in its chunk's slots."""

    shape: tuple[int, ...]
    dtype: Any
    dim: int | None
    """The dim split over ``tensor`` (None: the leaf is flattened and cut into ``T`` pieces)."""
    offset: int
    """Start of the leaf's part in each slot."""
    length: int
    """Elements of the leaf in each slot."""


def _dims(params: Sequence[Any], tensor: int, tensor_specs: Sequence[Any] | None) -> list[list[int | None]]:
    """Per layer, per leaf (in `jax.tree.leaves` order), the dim split over ``tensor``; raise `PipelineError`
    listing every spec that does not fit its leaf."""
    if tensor_specs is None or tensor == 1:
        return [[None] * len(jax.tree.leaves(p)) for p in params]
    if len(tensor_specs) != len(params):
        raise PipelineError(
            f"expected one tensor-parallel spec tree per layer ({len(params)} layers), found {len(tensor_specs)}; "
            "give the specs of the same layer list"
        )
    out, problems = [], []
    for li, (p, specs) in enumerate(zip(params, tensor_specs, strict=True)):
        leaves = jax.tree_util.tree_flatten_with_path(p)[0]
        flat = jax.tree.leaves(specs, is_leaf=is_spec)
        if len(flat) != len(leaves) or not all(is_spec(s) for s in flat):
            problems.append(
                f"layer {li}: expected a PartitionSpec per parameter leaf ({len(leaves)}), found {len(flat)} specs"
            )
            out.append([None] * len(leaves))
            continue
        dims = []
        for (path, x), spec in zip(leaves, flat, strict=True):
            where = f"layer {li} leaf {jax.tree_util.keystr(path) or '(root)'}"
            shape, d = jnp.shape(x), tensor_dim(spec)
            if len(spec) > len(shape):
                problems.append(f"{where}: spec {spec} names more dims than shape {shape} has")
            elif d is not None and shape[d] % tensor:
                problems.append(
                    f"{where}: spec {spec} splits dim {d} of shape {shape} over tensor={tensor}, which does not "
                    f"divide {shape[d]}"
                )
            dims.append(d if d is not None and d < len(shape) and shape[d] % tensor == 0 else None)
        out.append(dims)
    if problems:
        raise PipelineError(
            "tensor-parallel specs do not fit the layers' parameters:\n  "
            + "\n  ".join(problems)
            + "\nsplit only dims the tensor axis divides (or leave them whole), or use a tensor axis dividing them"
        )
    return out


class Packing:
    """How the chunks' parameters map to rows of the padded ``(V, S, N)`` buffer: chunk ``c`` in row
    ``(c // S, c % S)``, ``N = T * W`` for a tensor axis of ``T`` slots of ``W`` elements each (``W`` the widest
    chunk's slot, rounded up to a multiple of ``align``, so an ``fsdp`` axis of that size divides each slot), in one
    dtype (the parameters' common one). ``tensor_specs``: per layer, a `PartitionSpec` per parameter leaf (a pytree
    like the layer's parameters); a leaf whose spec puts a dim on ``tensor`` is split along it (the other axes it
    names are ignored: ZeRO inside a stage shards the buffer itself)."""

    def __init__(
        self,
        params: Sequence[Any],
        partition: StagePartition,
        schedule: Schedule,
        align: int = 1,
        *,
        tensor: int = 1,
        tensor_specs: Sequence[Any] | None = None,
    ):
        if tensor < 1:
            raise PipelineError(f"tensor must be a positive int (the mesh's tensor axis), found {tensor!r}")
        self.stages = partition.stages
        self.num_stages, self.num_virtual = schedule.num_stages, schedule.num_virtual
        self.tensor = tensor
        self.num_layers = len(params)
        self.layer_dims = _dims(params, tensor, tensor_specs)
        self.layer_shapes = [[tuple(jnp.shape(x)) for x in jax.tree.leaves(p)] for p in params]
        self.treedefs, self.leaves = [], []
        for r in self.stages:
            leaves, treedef = jax.tree.flatten(tuple(params[i] for i in r))
            dims = [d for i in r for d in self.layer_dims[i]]
            laid, offset = [], 0
            for x, d in zip(leaves, dims, strict=True):
                shape = tuple(jnp.shape(x))
                length = math.prod(shape) // tensor if d is not None else -(-math.prod(shape) // tensor)
                laid.append(_Leaf(shape, jnp.result_type(x), d, offset, length))
                offset += length
            self.treedefs.append(treedef)
            self.leaves.append(laid)
        self.widths = [sum(leaf.length for leaf in c) for c in self.leaves]
        self.slot = -(-max(max(self.widths), 1) // align) * align
        self.width = tensor * self.slot
        dtypes = [leaf.dtype for c in self.leaves for leaf in c if math.prod(leaf.shape)]
        self.dtype = jnp.result_type(*dtypes or [jnp.float32])

    def _key(self) -> tuple:
        stages = tuple((r.start, r.stop) for r in self.stages)
        leaves = tuple((x.shape, str(x.dtype), x.dim) for c in self.leaves for x in c)
        return (
            stages,
            self.num_virtual,
            self.tensor,
            self.slot,
            str(self.dtype),
            leaves,
            tuple(map(str, self.treedefs)),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Packing) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(V, S, N)``."""
        return (self.num_virtual, self.num_stages, self.width)

    @property
    def tensor_specs(self) -> list[tuple[P, ...]]:
        """Per layer, the `PartitionSpec` of each parameter leaf (in `jax.tree.leaves` order) inside a stage: its
        tensor-split dim on ``tensor``. What the packing was made with, to pack the same layers again."""
        return [
            tuple(_leaf_spec(len(s), d) for s, d in zip(shapes, dims, strict=True))
            for shapes, dims in zip(self.layer_shapes, self.layer_dims, strict=True)
        ]

    def _row(self, c: int, chunk: Any) -> jax.Array:
        t = self.tensor
        parts = []
        for x, leaf in zip(jax.tree.leaves(chunk), self.leaves[c], strict=True):
            x = jnp.asarray(x, self.dtype)
            if leaf.dim is None:
                flat = jnp.ravel(x)
                parts.append(jnp.pad(flat, (0, t * leaf.length - flat.size)).reshape(t, leaf.length))
            else:
                k, shape = leaf.dim, leaf.shape
                blocks = x.reshape(*shape[:k], t, shape[k] // t, *shape[k + 1 :])
                parts.append(jnp.moveaxis(blocks, k, 0).reshape(t, leaf.length))
        slots = jnp.concatenate(parts, axis=1) if parts else jnp.zeros((t, 0), self.dtype)
        return jnp.pad(slots, ((0, 0), (0, self.slot - slots.shape[1]))).reshape(self.width)

    def pack(self, params: Sequence[Any]) -> jax.Array:
        """The ``(V, S, N)`` buffer holding ``params`` (one pytree per layer)."""
        rows = [self._row(c, tuple(params[i] for i in r)) for c, r in enumerate(self.stages)]
        s = self.num_stages
        return jnp.stack([jnp.stack(rows[v * s : (v + 1) * s]) for v in range(self.num_virtual)])

    def chunk_params(self, c: int, row: jax.Array, *, constrain: bool = False) -> tuple[Any, ...]:
        """Chunk ``c``'s layer parameters (a tuple, one pytree per layer) from its row of ``N`` elements. With
        ``constrain`` (inside a step whose ``tensor`` axis is left to XLA) the slots and each tensor-split leaf are
        placed over ``tensor`` and the other leaves replicated, so the stage's layers run tensor-parallel."""
        t = self.tensor
        slots = row.reshape(t, self.slot)
        if constrain:
            slots = jax.lax.with_sharding_constraint(slots, P(TENSOR, None))
        out = []
        # one split of the row into the leaves' consecutive parts: its transpose (the gradient row) is one
        # concatenate, where a slice per leaf transposes to a full-row pad per leaf that XLA keeps two rows of
        cuts = [leaf.offset + leaf.length for leaf in self.leaves[c]]
        parts = jnp.split(slots[:, : cuts[-1]], cuts[:-1], axis=1) if cuts else []
        for leaf, part in zip(self.leaves[c], parts, strict=True):
            size = math.prod(leaf.shape)
            if leaf.dim is None:
                x = part.reshape(t * leaf.length)[:size].reshape(leaf.shape)
            else:
                k, shape = leaf.dim, leaf.shape
                local = (*shape[:k], shape[k] // t, *shape[k + 1 :])
                x = jnp.moveaxis(part.reshape(t, *local), 0, k).reshape(shape)
            if constrain:
                x = jax.lax.with_sharding_constraint(x, _leaf_spec(len(leaf.shape), leaf.dim))
            out.append(x.astype(leaf.dtype))
        return jax.tree.unflatten(self.treedefs[c], out)

    def unpack(self, packed: jax.Array) -> list[Any]:
        """The per-layer pytrees held in a ``(V, S, N)`` buffer (`pack`'s inverse)."""
        out: list[Any] = [None] * self.num_layers
        s = self.num_stages
        for c, r in enumerate(self.stages):
            for li, p in zip(r, self.chunk_params(c, packed[c // s, c % s]), strict=True):
                out[li] = p
        return out


def _leaf_spec(rank: int, dim: int | None) -> P:
    return P(*[TENSOR if i == dim else None for i in range(rank)])
