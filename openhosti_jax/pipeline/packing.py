"""How a pipeline's chunks of layers hold their parameters: one padded ``(V, S, N)`` buffer, row ``(v, d)`` the
parameters of chunk ``v * S + d``, so stages with different parameter structures share one array sharded over the
mesh's ``stage`` axis.

With a ``tensor`` axis of size ``T`` a row is ``T`` equal slots, slot ``t`` holding tensor rank ``t``'s part of every
leaf: the ``t``-th block of a leaf split along its tensor-parallel dim (the dim its `PartitionSpec` puts on
``tensor``, Megatron's column or row split), and the ``t``-th piece of any other leaf flattened. Sharding the last
dim over ``tensor`` then gives each rank its own blocks, and `Packing.chunk_params` rebuilds the leaves from the
slots with the split dims sharded over ``tensor``, so XLA partitions the stage's layers over it. With ``T = 1`` a
row is the chunk's leaves flattened one after the other (`jax.flatten_util.ravel_pytree`'s order).

With an ``expert`` axis of size ``X`` and leaves whose spec puts a dim on ``expert`` (a mixture-of-experts layer's
stacked experts), a row is ``X`` equal expert slots, each ``T`` tensor slots: expert slot ``x`` holds the ``x``-th
block of every such leaf along its experts dim and a copy of every other leaf (those come first in each slot, so
the copies are one prefix a stage all-reduces over ``expert``). Sharding the last dim over ``expert`` gives each
expert rank its own experts, their gradients and optimizer state, and `Packing.chunk_params` of one expert slot
gives that rank's leaves, its experts' dims ``1/X`` of the whole.

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
from openhosti_jax.sharding.specs import axis_dim, is_spec

EXPERT = "expert"
"""The mesh axis a stage's experts are split over."""


class _Leaf(NamedTuple):
    """Where one parameter leaf sits in its chunk's slots."""

    shape: tuple[int, ...]
    dtype: Any
    dim: int | None
    """The dim split over ``tensor`` (None: the leaf is flattened and cut into ``T`` pieces)."""
    edim: int | None
    """The experts dim split over ``expert`` (None: every expert slot holds the whole leaf)."""
    offset: int
    """Start of the leaf's part in each tensor slot."""
    length: int
    """Elements of the leaf in each tensor slot."""


def _local_shape(shape: tuple[int, ...], edim: int | None, expert: int) -> tuple[int, ...]:
    """One expert rank's shape of a leaf: its experts dim ``1/expert`` of the whole."""
    return shape if edim is None else (*shape[:edim], shape[edim] // expert, *shape[edim + 1 :])


def _dims(
    params: Sequence[Any], tensor: int, expert: int, tensor_specs: Sequence[Any] | None
) -> list[list[tuple[int | None, int | None]]]:
    """Per layer, per leaf (in `jax.tree.leaves` order), (the dim split over ``tensor``, the dim split over
    ``expert``); raise `PipelineError` listing every spec that does not fit its leaf."""
    if tensor_specs is None or (tensor == 1 and expert == 1):
        return [[(None, None)] * len(jax.tree.leaves(p)) for p in params]
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
            out.append([(None, None)] * len(leaves))
            continue
        dims = []
        for (path, x), spec in zip(leaves, flat, strict=True):
            where = f"layer {li} leaf {jax.tree_util.keystr(path) or '(root)'}"
            shape = tuple(jnp.shape(x))
            d = tensor_dim(spec) if tensor > 1 else None
            e = axis_dim(spec, EXPERT) if expert > 1 else None
            if len(spec) > len(shape):
                problems.append(f"{where}: spec {spec} names more dims than shape {shape} has")
                dims.append((None, None))
                continue
            for name, k, n in ((TENSOR, d, tensor), (EXPERT, e, expert)):
                if k is not None and shape[k] % n:
                    problems.append(
                        f"{where}: spec {spec} splits dim {k} of shape {shape} over {name}={n}, which does not "
                        f"divide {shape[k]}"
                    )
            if d is not None and d == e:
                problems.append(f"{where}: spec {spec} splits dim {d} over both tensor and expert")
            dims.append((d, e))  # any that does not fit is a problem raised below
        out.append(dims)
    if problems:
        raise PipelineError(
            "tensor- and expert-parallel specs do not fit the layers' parameters:\n  "
            + "\n  ".join(problems)
            + "\nsplit only dims the axis divides (or leave them whole), or use a tensor / expert axis dividing them"
        )
    return out


class Packing:
    """How the chunks' parameters map to rows of the padded ``(V, S, N)`` buffer: chunk ``c`` in row
    ``(c // S, c % S)``, ``N = X * T * W`` for ``X`` expert slots of ``T`` tensor slots of ``W`` elements each
    (``W`` the widest chunk's slot, rounded up to a multiple of ``align``, so an ``fsdp`` axis of that size divides
    each slot), in one dtype (the parameters' common one). ``tensor_specs``: per layer, a `PartitionSpec` per
    parameter leaf (a pytree like the layer's parameters); a leaf whose spec puts a dim on ``tensor`` is split along
    it, one whose spec puts a dim on ``expert`` is split along that one over the expert slots (the other axes a
    spec names are ignored: ZeRO inside a stage shards the buffer itself). ``X`` is ``expert`` where some leaf is
    split over it, else 1 (a model without experts is not copied into expert slots)."""

    def __init__(
        self,
        params: Sequence[Any],
        partition: StagePartition,
        schedule: Schedule,
        align: int = 1,
        *,
        tensor: int = 1,
        expert: int = 1,
        tensor_specs: Sequence[Any] | None = None,
    ):
        for name, n in (("tensor", tensor), ("expert", expert)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise PipelineError(f"{name} must be a positive int (the mesh's {name} axis), found {n!r}")
        self.stages = partition.stages
        self.num_stages, self.num_virtual = schedule.num_stages, schedule.num_virtual
        self.tensor = tensor
        self.num_layers = len(params)
        dims = _dims(params, tensor, expert, tensor_specs)
        self.layer_dims = [[d for d, _ in layer] for layer in dims]
        self.layer_edims = [[e for _, e in layer] for layer in dims]
        self.expert = expert if any(e is not None for layer in self.layer_edims for e in layer) else 1
        self.layer_shapes = [[tuple(jnp.shape(x)) for x in jax.tree.leaves(p)] for p in params]
        self.treedefs, self.leaves, self.shared = [], [], []
        for r in self.stages:
            leaves, treedef = jax.tree.flatten(tuple(params[i] for i in r))
            chunk_dims = [d for i in r for d in dims[i]]
            lengths = []
            for x, (d, e) in zip(leaves, chunk_dims, strict=True):
                size = math.prod(_local_shape(tuple(jnp.shape(x)), e, self.expert))
                lengths.append(size // tensor if d is not None else -(-size // tensor))
            # the leaves every expert slot holds whole first, then the experts: the copies are one prefix
            order = sorted(range(len(leaves)), key=lambda j: chunk_dims[j][1] is not None)
            offsets, offset = [0] * len(leaves), 0
            for j in order:
                offsets[j] = offset
                offset += lengths[j]
            self.leaves.append(
                [
                    _Leaf(tuple(jnp.shape(x)), jnp.result_type(x), d, e, o, n)
                    for x, (d, e), o, n in zip(leaves, chunk_dims, offsets, lengths, strict=True)
                ]
            )
            self.shared.append(sum(n for n, (_, e) in zip(lengths, chunk_dims, strict=True) if e is None))
            self.treedefs.append(treedef)
        self.widths = [sum(leaf.length for leaf in c) for c in self.leaves]
        self.slot = -(-max(max(self.widths), 1) // align) * align
        self.width = self.expert * tensor * self.slot
        dtypes = [leaf.dtype for c in self.leaves for leaf in c if math.prod(leaf.shape)]
        self.dtype = jnp.result_type(*dtypes or [jnp.float32])

    def _key(self) -> tuple:
        stages = tuple((r.start, r.stop) for r in self.stages)
        leaves = tuple((x.shape, str(x.dtype), x.dim, x.edim) for c in self.leaves for x in c)
        return (
            stages,
            self.num_virtual,
            self.tensor,
            self.expert,
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
    def expert_slot(self) -> int:
        """Elements of one expert slot (``T * W``): what one expert rank holds of a row."""
        return self.tensor * self.slot

    @property
    def tensor_specs(self) -> list[tuple[P, ...]]:
        """Per layer, the `PartitionSpec` of each parameter leaf (in `jax.tree.leaves` order) inside a stage: its
        tensor-split dim on ``tensor``, its experts dim on ``expert``. What the packing was made with, to pack the
        same layers again."""
        return [
            tuple(_leaf_spec(len(s), d, e) for s, d, e in zip(shapes, dims, edims, strict=True))
            for shapes, dims, edims in zip(self.layer_shapes, self.layer_dims, self.layer_edims, strict=True)
        ]

    def local_shape(self, leaf: _Leaf) -> tuple[int, ...]:
        """One expert rank's shape of ``leaf`` (the whole shape unless it is split over ``expert``)."""
        return _local_shape(leaf.shape, leaf.edim, self.expert)

    def expert_elements(self, c: int) -> int:
        """Elements of chunk ``c``'s experts one expert rank holds (0 without experts split over ``expert``)."""
        return sum(math.prod(self.local_shape(x)) for x in self.leaves[c] if x.edim is not None)

    def _slots(self, x: jax.Array, leaf: _Leaf) -> jax.Array:
        """``(T, length)``: one expert rank's part ``x`` of ``leaf`` cut into its tensor slots."""
        t = self.tensor
        if leaf.dim is None:
            flat = jnp.ravel(x)
            return jnp.pad(flat, (0, t * leaf.length - flat.size)).reshape(t, leaf.length)
        k, shape = leaf.dim, x.shape
        blocks = x.reshape(*shape[:k], t, shape[k] // t, *shape[k + 1 :])
        return jnp.moveaxis(blocks, k, 0).reshape(t, leaf.length)

    def _row(self, c: int, chunk: Any) -> jax.Array:
        n_x, t = self.expert, self.tensor
        parts = []
        for x, leaf in sorted(zip(jax.tree.leaves(chunk), self.leaves[c], strict=True), key=lambda p: p[1].offset):
            x = jnp.asarray(x, self.dtype)
            if leaf.edim is None or n_x == 1:
                part = jnp.broadcast_to(self._slots(x, leaf), (n_x, t, leaf.length))
            else:  # expert rank r's block of the experts in expert slot r
                k, shape = leaf.edim, leaf.shape
                ranks = jnp.moveaxis(x.reshape(*shape[:k], n_x, shape[k] // n_x, *shape[k + 1 :]), k, 0)
                part = jax.vmap(lambda y, leaf=leaf: self._slots(y, leaf))(ranks)
            parts.append(part)
        slots = jnp.concatenate(parts, axis=2) if parts else jnp.zeros((n_x, t, 0), self.dtype)
        return jnp.pad(slots, ((0, 0), (0, 0), (0, self.slot - slots.shape[2]))).reshape(self.width)

    def pack(self, params: Sequence[Any]) -> jax.Array:
        """The ``(V, S, N)`` buffer holding ``params`` (one pytree per layer)."""
        rows = [self._row(c, tuple(params[i] for i in r)) for c, r in enumerate(self.stages)]
        s = self.num_stages
        return jnp.stack([jnp.stack(rows[v * s : (v + 1) * s]) for v in range(self.num_virtual)])

    def chunk_params(self, c: int, row: jax.Array, *, constrain: bool = False) -> tuple[Any, ...]:
        """Chunk ``c``'s layer parameters (a tuple, one pytree per layer) from one expert slot of its row (``T *
        W`` elements, the whole row without expert slots): one expert rank's leaves, its experts only where they
        are split over ``expert``. With ``constrain`` (inside a step whose ``tensor`` axis is left to XLA) the
        slots and each tensor-split leaf are placed over ``tensor`` and the other leaves replicated, so the
        stage's layers run tensor-parallel."""
        t = self.tensor
        slots = row.reshape(t, self.slot)
        if constrain:
            slots = jax.lax.with_sharding_constraint(slots, P(TENSOR, None))
        # one split of the row into the leaves' consecutive parts: its transpose (the gradient row) is one
        # concatenate, where a slice per leaf transposes to a full-row pad per leaf that XLA keeps two rows of
        laid = sorted(range(len(self.leaves[c])), key=lambda j: self.leaves[c][j].offset)
        cuts = [self.leaves[c][j].offset + self.leaves[c][j].length for j in laid]
        pieces = jnp.split(slots[:, : cuts[-1]], cuts[:-1], axis=1) if cuts else []
        parts: list[Any] = [None] * len(laid)
        for j, piece in zip(laid, pieces, strict=True):
            parts[j] = piece
        out = []
        for leaf, part in zip(self.leaves[c], parts, strict=True):
            shape = self.local_shape(leaf)
            if leaf.dim is None:
                x = part.reshape(t * leaf.length)[: math.prod(shape)].reshape(shape)
            else:
                k = leaf.dim
                local = (*shape[:k], shape[k] // t, *shape[k + 1 :])
                x = jnp.moveaxis(part.reshape(t, *local), 0, k).reshape(shape)
            if constrain:
                x = jax.lax.with_sharding_constraint(x, _leaf_spec(len(shape), leaf.dim, None))
            out.append(x.astype(leaf.dtype))
        return jax.tree.unflatten(self.treedefs[c], out)

    def unpack(self, packed: jax.Array) -> list[Any]:
        """The per-layer pytrees held in a ``(V, S, N)`` buffer (`pack`'s inverse): each leaf whole, its experts
        gathered from the expert slots (a leaf every slot holds is read from the first)."""
        out: list[Any] = [None] * self.num_layers
        s, n_x = self.num_stages, self.expert
        for c, r in enumerate(self.stages):
            slots = packed[c // s, c % s].reshape(n_x, self.expert_slot)
            ranks = [jax.tree.leaves(self.chunk_params(c, slots[x])) for x in range(n_x)]
            leaves = [
                ranks[0][j] if leaf.edim is None else jnp.concatenate([rank[j] for rank in ranks], axis=leaf.edim)
                for j, leaf in enumerate(self.leaves[c])
            ]
            for li, p in zip(r, jax.tree.unflatten(self.treedefs[c], leaves), strict=True):
                out[li] = p
        return out


def _leaf_spec(rank: int, dim: int | None, edim: int | None) -> P:
    return P(*[TENSOR if i == dim else EXPERT if i == edim else None for i in range(rank)])
