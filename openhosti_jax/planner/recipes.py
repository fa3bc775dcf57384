"""A peer stack's saved activations from its published recipe: what its activation checkpointing keeps per
transformer layer (`openhosti_jax.planner.stacks.Stack.saves`), in bytes, for the layer this library's model traces.

This library prices its own step from its own residual trace (`openhosti_jax.planner.workload`). A peer stack runs
the same model with other kernels and another checkpointing rule: Megatron-Core's selective recomputation keeps
every input its fused layer's backward reads but the attention core's, MaxText's ``minimal`` policy the projections'
outputs, torchtitan's op-level selective checkpointing every other matmul's output and the attention output. Each
rule names tensors of a layer (`openhosti_jax.planner.stacks.LAYER_TENSORS`); `layer_shape` reads their widths per
token from the trace (the layer scan's projections in the order the forward calls them), and `saved_bytes` prices a
stack's rule: each saved tensor of every layer, one layer's others while the backward recomputes them, and the
loss head's logits at the stack's bytes per element (`Stack.logits_bytes`).

Example:
    >>> from openhosti_jax.models.presets import model_preset
    >>> from openhosti_jax.planner.workload import workload
    >>> p = model_preset("llama3-8b", n_layers=2, seq_len=1024)
    >>> s = layer_shape(workload(p.init, p.sample_batch(1)))
    >>> s.layers, s.width, s.qkv, s.context, s.mlp_in, s.mlp_act, s.vocab  # GQA: q 4096, k and v 1024 each
    (2, 4096, 6144, 4096, 28672, 14336, 128256)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from openhosti_jax.flops import matmul_flops
from openhosti_jax.jaxpr_walk import calls
from openhosti_jax.planner.stacks import EVERY_RESIDUAL, Stack
from openhosti_jax.planner.workload import Workload


class LayerShape(NamedTuple):
    """One transformer layer's tensors, as elements per token (`layer_shape`)."""

    layers: int
    """Layers in the scanned stack."""
    width: int
    """The residual stream: the layer's input, the out projection's and the MLP's output."""
    qkv: int
    """The projections before attention, their outputs together (query, key and value)."""
    context: int
    """Attention's output: the out projection's input."""
    mlp_in: int
    """The MLP's input projections' outputs together (gate and up for a gated MLP)."""
    mlp_act: int
    """The MLP's activation output: its last projection's input."""
    every_other: tuple[int, int]
    """The 1st, 3rd, 5th, ... projections' outputs in the order the forward calls them, as (those split over a
    tensor axis, those whole: a row-parallel projection's all-reduced output)."""
    vocab: int
    """Logits per token (the head's output width)."""


def _dots(jaxpr: Any) -> Iterator[Any]:
    """``jaxpr``'s ``dot_general`` equations in program order, each nested jaxpr entered where it is called (by
    `openhosti_jax.jaxpr_walk.calls`' rule: a cond's costliest branch)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for call in calls(eqn, matmul_flops):
            yield from _dots(call.jaxpr)


def _layer_scan(jaxpr: Any, layers: int) -> Any | None:
    """The body of the first scan over ``layers`` trips that runs attention (a batched matmul), else None."""
    for eqn in jaxpr.eqns:
        for call in calls(eqn, matmul_flops):
            batched = any(e.params["dimension_numbers"][1][0] for e in _dots(call.jaxpr))
            if eqn.primitive.name == "scan" and call.trips == layers and batched:
                return call.jaxpr
            if (found := _layer_scan(call.jaxpr, layers)) is not None:
                return found
    return None


def _widths(eqn: Any) -> tuple[int, int]:
    """(input, output) elements per token of a projection ``activation @ weight`` (the activation its lhs, as
    `flax.nnx.Linear` and ``x @ w`` trace)."""
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    contracted = 1
    for d in lc:
        contracted *= lhs.shape[d]
    tokens = lhs.size // contracted
    return contracted, eqn.outvars[0].aval.size // tokens


def layer_shape(work: Workload) -> LayerShape | None:
    """The per-token widths of ``work``'s transformer layer, from its trace: in the forward's scan over the layers
    (`Workload.layer_count`), the projections (matmuls without batch dims) before attention (matmuls with them) are
    the query / key / value projections; after it the first is the out projection, the last the MLP's output
    projection and those between its input projections; the head is the last projection after the scan. None where
    the model has no such layer scan (no scanned blocks, no attention, fewer than two projections after it, an
    output other than the residual stream) or routes tokens to experts: a recipe cannot be priced on it, and its
    stack's activations come from the trace."""
    if work.jaxpr is None or not work.layer_count or work.experts().num_experts:
        return None

    def read() -> LayerShape | None:
        body = _layer_scan(work.jaxpr, work.layer_count)
        if body is None:
            return None
        before, after, seen = [], [], False
        for eqn in _dots(body):
            if eqn.params["dimension_numbers"][1][0]:  # batch dims: attention
                seen = True
            else:
                (after if seen else before).append(_widths(eqn))
        if not before or len(after) < 2:
            return None
        width = after[0][1]
        if after[-1][1] != width:
            return None
        order = [*before, *after]
        row_parallel = {len(before), len(order) - 1}  # the out projection and the MLP's last: outputs all-reduced
        split = sum(w for i, (_, w) in enumerate(order) if i % 2 == 0 and i not in row_parallel)
        whole = sum(w for i, (_, w) in enumerate(order) if i % 2 == 0 and i in row_parallel)
        head = [_widths(e) for e in _dots(work.jaxpr) if not e.params["dimension_numbers"][1][0]]
        return LayerShape(
            work.layer_count,
            width,
            sum(w for _, w in before),
            after[0][0],
            sum(w for _, w in after[1:-1]),
            after[-1][0],
            (split, whole),
            head[-1][1] if head else 0,
        )

    return work.memo(("layer shape",), read)


def _tensor_bytes(name: str, s: LayerShape, itemsize: int, t: int, sequence: bool) -> float:
    """Bytes per token of one layer tensor of `openhosti_jax.planner.stacks.LAYER_TENSORS` on one device: split over
    a tensor axis of ``t`` where the tensor-parallel projections split it (the heads' and the MLP's widths), or
    everywhere under sequence parallelism; the residual stream, the norms' outputs and the dropout masks whole
    otherwise (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section
    4.2: ``sbh (10 + 24 / t)`` per layer without sequence parallelism, ``34 sbh / t`` with it)."""

    def per_device(elements: float, split: bool) -> float:
        return elements / max(t, 1) if split or sequence else elements

    if name == "every_other":
        return itemsize * (per_device(s.every_other[0], True) + per_device(s.every_other[1], False))
    elements, split = {
        "input": (s.width, False),
        "residual": (s.width, False),
        "norms": (2 * s.width, False),
        "qkv": (s.qkv, True),
        "context": (s.context, True),
        "attn_out": (s.width, False),
        "mlp_in": (s.mlp_in, True),
        "mlp_act": (s.mlp_act, True),
        "mlp_out": (s.width, False),
        "dropout_masks": (2 * s.width, False),  # the hidden dropouts after attention and the MLP
    }[name]
    return per_device(elements, split) * (1 if name == "dropout_masks" else itemsize)  # a mask: one byte


def saved_bytes(
    stack: Stack, work: Workload, remat: str, itemsize: int, t: int = 1, sequence: bool = False
) -> float | None:
    """Activation bytes per example (one sequence) that ``stack`` keeps for the backward under the remat policy
    ``remat`` (`Stack.saves`), on one device of a tensor axis of ``t`` (``sequence``: the activations split along the
    sequence over it too), activations of ``itemsize`` bytes: every layer's saved tensors, one layer's others
    re-made while the backward recomputes it (the residuals its backward reads, `EVERY_RESIDUAL`), and the loss
    head's logits at ``Stack.logits_bytes`` per element (vocabulary-parallel over ``t``). None where the stack has
    no recipe for ``remat`` or the model no layer to price it on (`layer_shape`): the trace prices it.

    >>> from openhosti_jax.models.presets import model_preset
    >>> from openhosti_jax.planner.stacks import STACKS
    >>> from openhosti_jax.planner.workload import workload
    >>> p = model_preset("llama3-8b", n_layers=32, seq_len=4096)
    >>> w = workload(p.init, p.sample_batch(1))
    >>> full = saved_bytes(STACKS["megatron-core"], w, "full", 2)  # the layer inputs, one layer's residuals, logits
    >>> full == 4096 * (32 * 2 * 4096 + 2 * (2 * 4096 + 4096 + 6144 + 4096 + 28672 + 14336) + 6 * 128256)
    True
    >>> saved_bytes(STACKS["openhosti"], w, "full", 2) is None  # this library's stack: its own trace
    True
    """
    parts = saved_parts(stack, work, remat, itemsize, t, sequence)
    return None if parts is None else parts[0]


def saved_parts(
    stack: Stack, work: Workload, remat: str, itemsize: int, t: int = 1, sequence: bool = False
) -> tuple[float, float, float] | None:
    """(`saved_bytes`, of it one layer's re-made residuals, of it the loss head's logits) per example; None as
    `saved_bytes`."""
    names = stack.saves.get(remat)
    shape = layer_shape(work) if names is not None else None
    if names is None or shape is None or stack.logits_bytes is None:
        return None
    per_layer = sum(_tensor_bytes(n, shape, itemsize, t, sequence) for n in names)
    remade = sum(_tensor_bytes(n, shape, itemsize, t, sequence) for n in EVERY_RESIDUAL if n not in names)
    logits = shape.vocab * stack.logits_bytes / max(t, 1)
    n = work.tokens_per_example
    return n * (shape.layers * per_layer + remade + logits), n * remade, n * logits
