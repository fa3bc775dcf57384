"""The layer sequence of a user's model, found without rewriting it: the forward pass traced once with each repeated
block's call marked, then cut at the marks into pipeline layers.

The blocks are those `openhosti_jax.state.blocks` finds (lists of one nnx class; identical linen siblings), or the
iterations of a scan over parameters stacked on a leading axis (``nn.scan``, ``nnx.scan``, ``jax.lax.scan``): the
scan is unrolled, each iteration one block holding its slice of the stacked parameters. Layer 0 is everything before
the first block (embeddings), then one layer per block (with whatever runs between it and the next), then everything
after the last (final norm, head). Each layer is a function ``f(params, carry) -> carry``:
its parameters are the model's parameter leaves it reads, and ``carry`` is the tuple of values later layers need
(the residual stream, and anything else computed early and read late). Values that do not depend on the inputs
(positions, causal masks, parameters cast to a compute dtype) are computed in each layer that reads them, from the
parameters that layer holds, instead of carried.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.models.gpt import GPT, GPTConfig
    >>> seq = split_layers(lambda r: GPT(GPTConfig.tiny(n_layers=3), rngs=nnx.Rngs(r)), jnp.zeros((2, 8), jnp.int32))
    >>> len(seq.layers), [len(p) for p in seq.params]  # embeddings, 3 blocks, final norm and head
    (5, [2, 11, 11, 11, 4])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PipelineError
from openhosti_jax.pipeline.tensor import active_size, unaligned_dims, whole_along
from openhosti_jax.sharding.rules import EXPERTS, logical_names
from openhosti_jax.state.blocks import BLOCK_NAME, marked_call
from openhosti_jax.state.context import active_policies, current_token_axes, marking_blocks
from openhosti_jax.state.model import model_parts


@dataclasses.dataclass(frozen=True, eq=False)
class LayerSequence:
    """A model cut into pipeline layers."""

    layers: list[Callable[[Any, Any], Any]]
    """``layers[i](params[i], carry) -> carry``; layer 0 takes the model's inputs, the last returns its outputs."""
    params: list[tuple[Any, ...]]
    """Each layer's abstract parameter leaves (the model's leaves in order, split by the layer that reads them)."""
    owners: tuple[tuple[int, int], ...]
    """For each layer leaf (a model leaf, or one slice of a stacked one): (layer, position in that layer's tuple)."""
    treedef: Any
    """The model's parameter tree structure."""
    stacks: tuple[int, ...]
    """For each leaf of the model's parameters: 0, or the number of slices it is cut into (stacked over a scan)."""

    def _key(self) -> tuple:
        shapes = tuple((tuple(jnp.shape(x)), str(jnp.result_type(x))) for p in self.params for x in p)
        return (self.treedef, self.owners, self.stacks, shapes)

    def __eq__(self, other: object) -> bool:
        """Sequences of the same parameter layout are interchangeable (a fresh state of the same model)."""
        return isinstance(other, LayerSequence) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def split(self, model_params: Any) -> list[tuple[Any, ...]]:
        """Per-layer leaves of the model's parameters (real or abstract), as `params` lays them out."""
        return self.split_flat(jax.tree.leaves(model_params), _slice)

    def split_flat(self, values: Sequence[Any], piece: Callable[[Any, int], Any]) -> list[tuple[Any, ...]]:
        """Per-layer values (as `params` lays the leaves out) from one value per model leaf, in `jax.tree.leaves`
        order; ``piece(value, j)`` is slice ``j``'s of a leaf stacked over the layer scan."""
        if len(values) != len(self.stacks):
            raise PipelineError(
                f"expected one value per model parameter leaf ({len(self.stacks)}), found {len(values)}; give "
                "them for this model's parameters"
            )
        flat = [
            y
            for x, n in zip(values, self.stacks, strict=True)
            for y in ([x] if n == 0 else map(piece, [x] * n, range(n)))
        ]
        out: list[list[Any]] = [[None] * len(p) for p in self.params]
        for value, (layer, i) in zip(flat, self.owners, strict=True):
            out[layer][i] = value
        return [tuple(x) for x in out]

    def split_specs(self, specs: Sequence[P]) -> list[tuple[P, ...]]:
        """Per-layer `PartitionSpec` s from one per model leaf (`split_flat`): each slice of a stacked leaf takes
        the leaf's spec less its first (stacked) dim."""
        return self.split_flat(specs, lambda spec, _: P(*spec[1:]))

    def merge(self, layer_params: Sequence[Sequence[Any]]) -> Any:
        """The model's parameter tree from per-layer leaves (parameters or gradients)."""
        flat = iter([layer_params[layer][i] for layer, i in self.owners])
        leaves = [next(flat) if n == 0 else jnp.stack([next(flat) for _ in range(n)]) for n in self.stacks]
        return jax.tree.unflatten(self.treedef, leaves)


def _slice(x: Any, j: int) -> Any:
    return _row(x) if isinstance(x, jax.ShapeDtypeStruct) else x[j]


def _row(x: Any) -> jax.ShapeDtypeStruct:
    """The abstract value of one slice of ``x`` over its leading axis."""
    return jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x))


def _depends(eqns: Sequence[Any], roots: set) -> set:
    out = set(roots)
    for eqn in eqns:
        if any(not isinstance(v, Literal) and v in out for v in eqn.invars):
            out.update(eqn.outvars)
    return out


def _needed_free(eqns: Sequence[Any], free_defs: dict, wanted: set) -> list[Any]:
    """The free (input-independent) equations computing ``wanted``, in program order."""
    need, stack = set(), list(wanted)
    while stack:
        v = stack.pop()
        eqn = free_defs.get(v)
        if eqn is None or id(eqn) in need:
            continue
        need.add(id(eqn))
        stack += [i for i in eqn.invars if not isinstance(i, Literal)]
    return [e for e in eqns if id(e) in need]


def _bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _evaluate(eqns: Sequence[Any], env: dict) -> None:
    """Bind ``eqns`` on the values in ``env``; inside a tensor-parallel stage (`tensor.stage_tensor`) nested calls
    run inline, so each ``split`` and ``slice`` in them gets its operand gathered where it must
    (`tensor.unaligned_dims`)."""
    t = active_size()
    for eqn in eqns:
        args = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
        if t > 1 and eqn.primitive.name in ("pjit", "jit"):
            inner = eqn.params["jaxpr"]
            sub = dict(zip(inner.jaxpr.constvars, inner.consts, strict=True))
            sub.update(zip(inner.jaxpr.invars, args, strict=True))
            _evaluate(inner.jaxpr.eqns, sub)
            out = [v.val if isinstance(v, Literal) else sub[v] for v in inner.jaxpr.outvars]
        elif t > 1 and unaligned_dims(eqn, t):  # cut whole, and the parts stay whole until they are used
            dims = unaligned_dims(eqn, t)
            out = [whole_along(x, dims) for x in _bind(eqn, [whole_along(args[0], dims), *args[1:]])]
        else:
            out = _bind(eqn, args)
        env.update(zip(eqn.outvars, out, strict=True))


_PER_SLICE = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
"""Primitives that act on each slice of a stacked parameter alone (a cast to the compute dtype)."""


def _layer_scan(jaxpr: Any, n_p: int) -> tuple[int, set[int]] | None:
    """The scan over parameters stacked on a leading axis (the one reading the most of them): its equation's index
    and the stacked parameters' indices; None when there is none."""
    origin = {v: i for i, v in enumerate(jaxpr.invars[:n_p])}
    best: tuple[int, set[int]] | None = None
    for k, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if not isinstance(v, Literal)]
        if eqn.primitive.name in _PER_SLICE and len(ins) == 1 and ins[0] in origin:
            origin[eqn.outvars[0]] = origin[ins[0]]
        elif eqn.primitive.name == "scan" and eqn.params["length"] >= 2:
            xs = eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"] :]
            found = {origin[v] for v in xs if not isinstance(v, Literal) and v in origin}
            if found and (best is None or len(found) > len(best[1])):
                best = (k, found)
    return best


@dataclasses.dataclass
class _Stack:
    """The slices of a value stacked over the layer scan, kept apart until something needs it whole."""

    slices: list[Any]
    param: str | None
    """The parameter's path, when it is one (a stacked parameter needed whole cannot be cut)."""

    def whole(self, reader: str) -> Any:
        if self.param is not None:
            raise PipelineError(
                f"parameter {self.param} is stacked over the layer scan and also read whole, by {reader}; a pipeline "
                "keeps each layer's slice on its own stage: read the stacked parameters only inside the scan"
            )
        return jnp.stack(self.slices)


def _unrolled(closed: Any, n_p: int, k: int, stacked: set[int], paths: Sequence[str]) -> Callable[..., list]:
    """A function of (parameter leaves, each stacked one as a list of slices; input leaves) that evaluates the
    traced program with the layer scan (equation ``k``) unrolled, each iteration a marked block call."""
    jaxpr, scan = closed.jaxpr, closed.jaxpr.eqns[k]
    body, nc, nk, n = scan.params["jaxpr"], scan.params["num_consts"], scan.params["num_carry"], scan.params["length"]

    def step(consts: list, carry: list, xs: list) -> list:
        env = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        env.update(zip(body.jaxpr.invars, [*consts, *carry, *xs], strict=True))
        _evaluate(body.jaxpr.eqns, env)
        return [v.val if isinstance(v, Literal) else env[v] for v in body.jaxpr.outvars]

    block = marked_call(step)

    def whole(x: Any, reader: str) -> Any:
        return x.whole(reader) if isinstance(x, _Stack) else x

    def unroll(args: list) -> list:
        consts, carry, xs = [whole(a, "the scan's constants") for a in args[:nc]], args[nc : nc + nk], args[nc + nk :]
        ys: list[list[Any]] = [[None] * n for _ in scan.outvars[nk:]]
        for j in reversed(range(n)) if scan.params["reverse"] else range(n):
            out = block(consts, carry, [x.slices[j] if isinstance(x, _Stack) else x[j] for x in xs])
            carry = out[:nk]
            for col, y in zip(ys, out[nk:], strict=True):
                col[j] = y
        return [*carry, *[_Stack(col, None) for col in ys]]

    def forward(params: list, inputs: list) -> list:
        env: dict = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        for i, (v, x) in enumerate(zip(jaxpr.invars[:n_p], params, strict=True)):
            env[v] = _Stack(x, paths[i]) if i in stacked else x
        env.update(zip(jaxpr.invars[n_p:], inputs, strict=True))
        for j, eqn in enumerate(jaxpr.eqns):
            args = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            if j == k:
                out = unroll(args)
            elif len(args) == 1 and isinstance(args[0], _Stack) and eqn.primitive.name in _PER_SLICE:
                out = [_Stack([_bind(eqn, [x])[0] for x in args[0].slices], args[0].param)]
            else:
                out = _bind(eqn, [whole(a, f"a {eqn.primitive.name}") for a in args])
            env.update(zip(eqn.outvars, out, strict=True))
        return [v.val if isinstance(v, Literal) else whole(env[v], "the model's outputs") for v in jaxpr.outvars]

    return forward


def _trace(forward: Any, params: Any, inputs: Any, paths: list[str], precision: str) -> tuple[Any, Any, tuple]:
    """The forward pass traced with its blocks marked: (program, output shapes, `LayerSequence.stacks`). A model
    whose blocks run as a scan over stacked parameters is traced again with the scan unrolled, its parameters
    passed slice by slice (``paths`` gains each slice's index)."""
    with marking_blocks(), active_policies("none", precision):
        closed, out_shape = jax.make_jaxpr(forward, return_shape=True)(params, inputs)
    leaves = jax.tree.leaves(params)
    found = None if len(_marks(closed.jaxpr.eqns)) >= 2 else _layer_scan(closed.jaxpr, len(leaves))
    if found is None:
        return closed, out_shape, (0,) * len(leaves)
    k, stacked = found
    n = closed.jaxpr.eqns[k].params["length"]
    run = _unrolled(closed, len(leaves), k, stacked, list(paths))
    sliced = [[_row(x)] * n if i in stacked else x for i, x in enumerate(leaves)]
    paths[:] = [f"{p}[{j}]" for i, p in enumerate(paths) for j in (range(n) if i in stacked else [None])]
    paths[:] = [p.removesuffix("[None]") for p in paths]
    closed = jax.make_jaxpr(run)(sliced, jax.tree.leaves(inputs))
    return closed, out_shape, tuple(n if i in stacked else 0 for i in range(len(leaves)))


def _marks(eqns: Sequence[Any]) -> list[int]:
    return [i for i, e in enumerate(eqns) if e.primitive.name in ("pjit", "jit") and e.params["name"] == BLOCK_NAME]


@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
    """The forward pass traced at one batch size and cut into segments."""

    consts: dict
    param_vars: list[Any]
    input_vars: list[Any]
    segments: list[list[Any]]
    free: list[list[Any]]
    carries: list[list[Any]]
    layer_params: list[list[int]]
    out_treedef: Any
    stacks: tuple[int, ...]

    def run(self, s: int, p: Sequence[Any], carry: Any) -> Any:
        values = jax.tree.leaves(carry) if s == 0 else list(carry)
        carry_in = self.input_vars if s == 0 else self.carries[s - 1]
        env = dict(self.consts)
        env.update(zip([self.param_vars[i] for i in self.layer_params[s]], p, strict=True))
        env.update(zip(carry_in, values, strict=True))
        _evaluate(self.free[s] + self.segments[s], env)
        out = [env[v] for v in self.carries[s]]
        return jax.tree.unflatten(self.out_treedef, out) if s == len(self.segments) - 1 else tuple(out)


def _live(jaxpr: Any) -> list[Any]:
    """The equations of ``jaxpr`` its outputs need (and any with effects), in program order: what the model
    computes and drops (a block's MoE statistics when the call does not return them) is not cut into layers."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    keep = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(o in needed for o in eqn.outvars):
            keep.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return keep[::-1]


def _cut(forward: Any, params: Any, inputs: Any, paths: Sequence[str], precision: str) -> _Program:
    paths = list(paths)
    closed, out_shape, stacks = _trace(forward, params, inputs, paths, precision)
    jaxpr = closed.jaxpr
    consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    eqns = _live(jaxpr)
    n_p = len(paths)
    param_vars, input_vars = list(jaxpr.invars[:n_p]), list(jaxpr.invars[n_p:])
    marks = _marks(eqns)
    if len(marks) < 2:
        raise PipelineError(
            f"found {len(marks)} repeated block(s) in the model's forward pass; a pipeline needs a sequence of at "
            "least two: keep the blocks in a list (nnx.List of one class, or identical linen submodules), or scan "
            "one block over parameters stacked on a leading axis (nn.scan, nnx.scan)"
        )
    bounds = [(0, marks[0])] + [(marks[k], marks[k + 1]) for k in range(len(marks) - 1)]
    bounds += [(marks[-1], marks[-1] + 1), (marks[-1] + 1, len(eqns))]
    # what does not depend on the inputs (positions, masks, parameters cast to the compute dtype) is computed in
    # each layer that reads it, from the parameters that layer holds
    live = _depends(eqns, set(input_vars))
    free_defs = {v: e for e in eqns if not any(o in live for o in e.outvars) for v in e.outvars}
    segments = [[e for e in eqns[a:b] if any(o in live for o in e.outvars)] for a, b in bounds]
    direct = [{v for e in seg for v in e.invars if not isinstance(v, Literal)} for seg in segments]
    free = [_needed_free(eqns, free_defs, {v for v in used if v in free_defs}) for used in direct]
    uses = [
        used | {v for e in f for v in e.invars if not isinstance(v, Literal)}
        for used, f in zip(direct, free, strict=True)
    ]
    outputs = [v for v in jaxpr.outvars if not isinstance(v, Literal)]
    param_index = {v: i for i, v in enumerate(param_vars)}
    owners: dict[int, int] = {}
    layer_params: list[list[int]] = [[] for _ in segments]
    for s, used in enumerate(uses):
        for i in sorted(param_index[u] for u in used if u in param_index):
            if i in owners:
                raise PipelineError(
                    f"parameter {paths[i]} is read by layers {owners[i]} and {s} (tied weights): a pipeline keeps "
                    "each parameter on one stage; untie it (e.g. tie_embeddings=False) to pipeline this model"
                )
            owners[i] = s
            layer_params[s].append(i)
    for i in range(n_p):  # a parameter nothing reads stays with the first layer
        if i not in owners:
            layer_params[0].append(i)
    carries: list[list[Any]] = []
    for s in range(len(segments)):
        later = set().union(*direct[s + 1 :]) if s + 1 < len(segments) else set()
        later |= set(outputs)
        made = input_vars + [o for seg in segments[: s + 1] for e in seg for o in e.outvars]
        keep = [v for v in made if v in later and v not in param_index and v not in free_defs and v not in consts]
        carries.append(list(dict.fromkeys(keep)))
    for s, carry in enumerate(carries[:-1]):
        bad = [str(v.aval) for v in carry if not carriable(v.aval.dtype)]
        if bad:
            raise PipelineError(
                f"layer {s} passes values {bad} to later layers; the pipeline carries activations as floats (and "
                "integers or booleans of at most 32 bits, exact below 2**24): compute them from those or where they "
                "are used"
            )
    carries[-1] = outputs
    return _Program(
        consts, param_vars, input_vars, segments, free, carries, layer_params, jax.tree.structure(out_shape), stacks
    )


def carriable(dtype: Any) -> bool:
    """Whether a value of ``dtype`` can travel between stages (`openhosti_jax.pipeline.executor`'s carrier)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return True
    return (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)) and jnp.dtype(dtype).itemsize <= 4


def _resize(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *jnp.shape(x)[1:]), jnp.result_type(x)), tree)


def split_layers(
    model: Any,
    sample_inputs: Any,
    *,
    apply_fn: Any = None,
    precision: str = "fp32",
    model_kwargs: Mapping[str, Any] | None = None,
) -> LayerSequence:
    """The `LayerSequence` of ``model`` (an nnx module, a linen module or an init function, as
    `openhosti_jax.state.model.model_parts` takes) on inputs shaped like ``sample_inputs`` (batch first). The
    forward pass is traced again for each batch size the layers are called with (a microbatch), and cut the same.
    ``precision`` (a name from `openhosti_jax.policies.precision.PRECISIONS` that keeps fp32 parameters) makes the
    layers compute in its compute dtype: each casts the parameters it holds. ``model_kwargs`` are passed to every
    call of the model (``{"with_aux": True}``: an MoE model's outputs are ``(logits, aux)``, each block's aux
    carried to the last layer). Inside `openhosti_jax.state.context.active_token_axes` (a pipeline stage) the layers
    are traced again for it, so a layer that combines statistics over the call's rows does so over those axes. A
    layer given one expert rank's block of its leaves' experts dims (their logical name
    `openhosti_jax.sharding.rules.EXPERTS`, ``1/X`` of the whole: a stage over an ``expert`` axis of size ``X``)
    is traced for those shapes, so its mixture-of-experts layers run the experts they are given.

    Raises `PipelineError` when the model has no sequence of at least two repeated blocks, when a parameter is
    read by two layers (tied weights), or when a value carried between layers is not a float, nor an integer or
    boolean of at most 32 bits."""
    parts = model_parts(model, sample_inputs, apply_fn=apply_fn)
    if parts.apply_fn is None:
        raise PipelineError("the model has no apply function to trace; pass apply_fn=")
    params = parts.params
    leaves, treedef = jax.tree.flatten(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    kwargs = dict(model_kwargs or {})
    # each leaf's stacked experts dim (its logical name `EXPERTS`): a stage may hold one expert rank's block of it
    edims = [names.index(EXPERTS) if names and EXPERTS in names else None for names in logical_names(params)]

    def forward(p: Any, x: Any) -> Any:
        return parts.apply_fn(p, x, model_state=parts.model_state, **kwargs)

    def expert_block(shards: int) -> Any:
        """The model's parameters with every experts dim ``1/shards`` of the whole (one expert rank's)."""
        local = [
            x if e is None else jax.ShapeDtypeStruct((*x.shape[:e], x.shape[e] // shards, *x.shape[e + 1 :]), x.dtype)
            for x, e in zip(leaves, edims, strict=True)
        ]
        return jax.tree.unflatten(treedef, local)

    sample = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), sample_inputs)
    programs: dict[tuple[int, tuple[str, ...], int], _Program] = {}

    def program(n: int, shards: int = 1) -> _Program:
        key = (n, current_token_axes(), shards)  # traced again inside a stage whose batch axes are manual
        if key not in programs:
            p = params if shards == 1 else expert_block(shards)
            programs[key] = _cut(forward, p, _resize(sample, n), paths, precision)
        return programs[key]

    n0 = jax.tree.leaves(sample)[0].shape[0]
    first = program(n0)
    carried = [[tuple(jnp.shape(x)) for x in jax.tree.leaves(sample)]]
    carried += [[tuple(v.aval.shape) for v in c] for c in first.carries[:-1]]

    def batch_size(s: int, carry: Any) -> int:
        """The batch size a carry into layer ``s`` was made for: ``n0`` scaled as the leading dim of the first
        leaf whose leading dim differs from the traced one (leaves that do not depend on the batch, such as an
        MoE block's statistics, keep theirs)."""
        for x, ref in zip(jax.tree.leaves(carry), carried[s], strict=True):
            if jnp.ndim(x) and ref and jnp.shape(x)[0] != ref[0]:
                return jnp.shape(x)[0] * n0 // ref[0]
        return n0

    def expert_shards(s: int, p: Any) -> int:
        """How many blocks of its experts layer ``s`` was given one of (1: the whole; a pipeline stage over an
        ``expert`` axis passes each rank its own experts)."""
        for x, ref, e in zip(jax.tree.leaves(p), sliced_params[s], layer_edims[s], strict=True):
            if e is not None and jnp.shape(x)[e] != ref.shape[e]:
                return ref.shape[e] // jnp.shape(x)[e]
        return 1

    def make_layer(s: int) -> Callable[[Any, Any], Any]:
        def layer(p: Any, carry: Any) -> Any:
            return program(batch_size(s, carry), expert_shards(s, p)).run(s, p, carry)

        return layer

    owners = {i: (s, k) for s, idx in enumerate(first.layer_params) for k, i in enumerate(idx)}
    sliced = [y for x, n in zip(leaves, first.stacks, strict=True) for y in ([x] if n == 0 else [_row(x)] * n)]
    sliced_edims = [
        y for e, n in zip(edims, first.stacks, strict=True) for y in ([e] if n == 0 else [e - 1 if e else None] * n)
    ]
    sliced_params = [tuple(sliced[i] for i in idx) for idx in first.layer_params]
    layer_edims = [tuple(sliced_edims[i] for i in idx) for idx in first.layer_params]
    return LayerSequence(
        [make_layer(s) for s in range(len(first.segments))],
        sliced_params,
        tuple(owners[i] for i in range(len(sliced))),
        treedef,
        first.stacks,
    )
