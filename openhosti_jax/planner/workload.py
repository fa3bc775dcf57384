"""What one training step asks of a device, from abstract shapes only: parameters, FLOPs, saved activations.

`workload` turns a model (an ``nnx.Module``, a linen module, or an ``init_fn(rng)``) and a sample batch into a
`Workload`. Activation bytes are the residuals reverse-mode AD saves for the backward pass (``jax.vjp`` traced
with `jax.make_jaxpr` at batch size 1, nothing allocated) that depend on the batch, minus those XLA can recompute
inside a fusion: a residual made by an elementwise op whose inputs are all saved anyway. `Workload.tensor_split`
says which of them (and of the matmuls) a tensor-parallel sharding splits (`propagate`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.planner.workload import workload
    >>> w = workload(nnx.Linear(256, 512, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((8, 256), jnp.float32))
    >>> w.global_batch, w.flops_per_example  # 3 x (2 * 256 * 512)
    (8, 786432.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.extend.core import Literal

from openhosti_jax.errors import BatchError
from openhosti_jax.flops import count_flops, dot_flops, matmul_flops, ragged_dot_flops, ragged_groups
from openhosti_jax.jaxpr_walk import calls, is_remat, nested_jaxprs
from openhosti_jax.planner.propagate import propagate
from openhosti_jax.policies.remat import KEEP_NAME, RECOMPUTE_FRACTION
from openhosti_jax.sharding.batch import batch_leaves, batch_size, per_row_keys
from openhosti_jax.sharding.rules import EXPERTS, LAYER_AXIS, logical_names, unbox
from openhosti_jax.sizes import leaf_bytes
from openhosti_jax.state.context import active_policies
from openhosti_jax.state.contracts import ApplyFn
from openhosti_jax.state.model import abstract, model_parts

_ELEMENTWISE = frozenset(
    "add sub mul div neg exp log log1p expm1 tanh logistic sqrt rsqrt integer_pow pow max min abs sign select_n "
    "convert_element_type broadcast_in_dim reshape squeeze expand_dims erf erfc erf_inv cos sin square".split()
)


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """Abstract description of a model and batch for the cost model."""

    params: Any
    """Abstract parameter tree (structure as the TrainState will hold it)."""
    model_state: Any
    """Non-parameter model variables (nnx), or None."""
    apply_fn: ApplyFn | None
    """``apply(params, batch, model_state)``; None when only parameters are known."""
    batch: Any
    """Abstract sample batch (global)."""
    global_batch: int
    """Leading dim of the batch."""
    flops_per_example: float
    """Training FLOPs (forward + backward = 3 x forward matmul FLOPs) per example."""
    activation_bytes_per_example: float
    """Materialised saved activations per example, the loss's (twice the outputs) included."""
    tokens_per_example: int
    """Positions per example (product of the output's middle dims; a classifier's, its token inputs'), for
    tensor-parallel all-reduce sizes and throughput."""
    activation_itemsize: int = 4
    """Bytes per activation element."""
    jaxpr: Any = None
    """The forward + VJP jaxpr at batch size 1 (parameters first, then the batch), when an apply_fn is known."""
    residuals: tuple[Any, ...] = ()
    """The per-example residuals of ``jaxpr`` counted in ``activation_bytes_per_example``."""
    outputs: tuple[Any, ...] = ()
    """The model's outputs among ``jaxpr``'s outvars (the loss on them adds their cotangent and one residual)."""
    state: Any = None
    """The abstract state a user's step takes, when the plan is made for that step (else a `TrainState` is built)."""
    layout: Any = None
    """Where ``state`` keeps its parameters and optimizer state (`openhosti_jax.state.layout.StateLayout`)."""
    step_fn: Any = None
    """The user's step the workload was measured from (`measure_step`), traced again under each policy."""
    _split_cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def layer_count(self) -> int | None:
        """The length of the parameters' ``"layers"`` axis (scanned blocks), or None when no leaf has one."""
        for x, names in zip(jax.tree.leaves(self.params), logical_names(self.params), strict=True):
            if names and names[0] == LAYER_AXIS:
                return int(x.shape[0])
        return None

    @property
    def loss_bytes_per_example(self) -> float:
        """What the loss holds per example at the forward's end, counted in ``activation_bytes_per_example``: two
        copies of the model's outputs (its softmax and the logits, or the outputs' cotangent at the backward's
        start)."""
        return 2.0 * sum(leaf_bytes(v) for v in self.outputs)

    def memo(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, made once per ``key`` (the search prices one workload thousands of times)."""
        key = ("memo", *key)
        if key not in self._split_cache:
            self._split_cache[key] = make()
        return self._split_cache[key]

    def opt_state(self, tx: Any) -> Any:
        """The abstract optimizer state of ``tx`` for ``params`` (traced once per optimizer); ``tx`` may be that
        state already (a user's ``(params, opt_state)``), or None."""
        if not isinstance(tx, optax.GradientTransformation):
            return tx
        key = ("opt", id(tx))
        if key not in self._split_cache:
            self._split_cache[key] = (tx, jax.eval_shape(tx.init, self.params))
        return self._split_cache[key][1]

    def policy_activations(self, remat: str, precision: str) -> PolicyActivations | None:
        """Activation bytes per example at the backward's peak and the FLOPs factor under the remat and precision
        policies, from a trace under them; None when the model does not apply policies (its step never calls a
        library apply function), so only ``("none", "fp32")`` can run."""
        if (remat, precision) == ("none", "fp32"):
            return PolicyActivations(self.activation_bytes_per_example, 1.0, 0.0, self.activation_bytes_per_example)
        key = ("policy", remat, precision)
        if key not in self._split_cache:
            self._split_cache[key] = self._trace_policies(remat, precision)
        return self._split_cache[key]

    def _trace_policies(self, remat: str, precision: str) -> PolicyActivations | None:
        if remat == "offload":  # keeps on the device what "full" keeps, the matmul outputs "dots" saves on the host
            full, dots = self.policy_activations("full", precision), self.policy_activations("dots", precision)
            if full is None or dots is None:
                return None
            host = max(dots.bytes_per_example - full.bytes_per_example, 0.0)
            return PolicyActivations(full.bytes_per_example, dots.flops_factor, host, full.checkpointed_per_example)
        one = _resize(self.batch, 1)
        if self.step_fn is not None and self.state is not None:
            with active_policies(remat, precision) as used:
                jaxprs = [jax.make_jaxpr(self.step_fn)(self.state, _resize(self.batch, k)).jaxpr for k in (1, 2)]
            if not used.applied:
                return None
            flops = count_flops(jaxprs[0], matmul_only=True)
            base = self.flops_per_example or flops
            return PolicyActivations(_growth(*jaxprs), flops / base if base else 1.0)
        if self.apply_fn is None:
            return None
        with active_policies(remat, precision) as used:
            traced = jax.make_jaxpr(_forward_vjp(self.apply_fn, self.model_state))(unbox(self.params), one)
        if not used.applied:
            return None
        n_params, n_out = len(jax.tree.leaves(unbox(self.params))), len(self.outputs)
        outputs = tuple(v for v in traced.jaxpr.outvars[:n_out] if not isinstance(v, Literal))
        saved = sum(leaf_bytes(v) for v in _saved(_per_example_residuals(traced.jaxpr, n_params, n_out), outputs))
        with active_policies(remat, precision):  # the forward alone still shows the checkpointed calls
            forward = jax.make_jaxpr(lambda p, x: self.apply_fn(p, x, model_state=self.model_state))(
                unbox(self.params), one
            )
        blocks = remat_blocks(forward.jaxpr)
        if remat == "none":
            return PolicyActivations(saved, 1.0, 0.0, saved)
        kept = self.policy_activations("none", precision)  # every residual, in this precision
        # during the backward one block at a time recomputes its residuals (all of them for a whole-model remat)
        recompute = max((kept.bytes_per_example if kept else saved) - saved, 0.0) / max(blocks, 1)
        factor = 1.0 + RECOMPUTE_FRACTION[remat]
        if remat == "selective":  # and the projections whose outputs the blocks do not keep, run again
            total = count_flops(forward.jaxpr, matmul_only=True)
            factor += _unkept_projection_flops(forward.jaxpr) / (3 * total) if total else 0.0
        return PolicyActivations(saved + recompute, factor, 0.0, saved)

    def gemm_sizes(self, batched: bool | None = None) -> tuple[tuple[float, float], ...]:
        """``(M N K of one call at batch size 1, its share of the matmul FLOPs)`` for every matmul of the traced step,
        equal sizes merged (each ``dot_general``, batch dims in its ``M N K``, a scan body's once per trip, of a
        ``cond`` the most expensive branch); empty without a trace. A training step's matmuls each carry the batch
        in one dim (tokens in M; in K for a weight gradient), so at ``b`` examples one call's ``M N K`` is ``b``
        times this, and its backward's two matmuls have the same ``M N K``. ``batched``: only the matmuls with
        (True, attention's) or without (False, the projections) batch dims.

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> w = workload(nnx.Linear(256, 512, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((8, 256), jnp.float32))
        >>> w.gemm_sizes()  # one example's 1 x 256 by 256 x 512
        ((131072.0, 1.0),)
        """
        merged: dict[float, float] = {}
        for mnk, share, _ in self.gemm_table(batched):
            merged[mnk] = merged.get(mnk, 0.0) + share
        return tuple(sorted(merged.items()))

    def gemm_table(self, batched: bool | None = None) -> tuple[tuple[float, float, bool], ...]:
        """`gemm_sizes` with each size marked grouped or not: a grouped matmul (``ragged_dot_general``, a
        mixture-of-experts layer's experts) counts one group's ``M N K`` (its rows over the groups: the per-expert
        token count when routing is balanced), which expert parallelism multiplies by the ``expert`` axis's size
        (each device's experts get the rows of that many devices)."""
        if self.jaxpr is None:
            return ()

        def walk() -> tuple[tuple[float, float, bool], ...]:
            sizes: dict[tuple[float, bool], float] = {}
            _gemms(self.jaxpr, 1.0, sizes, batched)
            total = sum(sizes.values())
            return tuple((mnk, f / total, g) for (mnk, g), f in sorted(sizes.items())) if total else ()

        return self.memo(("gemms", batched), walk)

    def experts(self) -> ExpertWork:
        """The mixture-of-experts layers' work per example (`ExpertWork`), from the parameters' logical names (the
        expert count: the size of a dim named ``"experts"``) and the trace (the grouped matmuls); zeros for a dense
        model.

        >>> from openhosti_jax.models.presets import model_preset
        >>> p = model_preset("mixtral-8x7b", n_layers=2, seq_len=64)
        >>> e = workload(p.init, p.sample_batch(1)).experts()
        >>> e.num_experts, e.layers, e.rows_per_example, e.width  # 2 layers x 64 tokens x top-2, d_model 4096
        (8, 2.0, 256.0, 4096)
        """

        def walk() -> ExpertWork:
            count = 0
            for x, names in zip(jax.tree.leaves(self.params), logical_names(self.params), strict=True):
                if names and EXPERTS in names:
                    count = max(count, int(x.shape[list(names).index(EXPERTS)]))
            if not count or self.jaxpr is None:
                return ExpertWork(count, 0.0, 0.0, 0, 0.0, 0.0)
            acc = {"rows": 0.0, "layers": 0.0, "width": 0.0, "flops": 0.0, "bytes": 0.0, "grouped": 0.0}
            n_params = len(jax.tree.leaves(unbox(self.params)))
            _expert_walk(self.jaxpr, 1.0, set(self.jaxpr.invars[n_params:]), set(), acc)
            total = count_flops(self.jaxpr, matmul_only=True)
            share = acc["flops"] / total if total else 0.0
            grouped = acc["grouped"] > 0
            return ExpertWork(count, acc["layers"], acc["rows"], int(acc["width"]), share, acc["bytes"], grouped)

        return self.memo(("experts",), walk)

    def attention_work(self) -> AttentionWork:
        """What the forward pass does per example besides the projections (`AttentionWork`), from the trace: the
        bytes its elementwise ops read and write when each is a kernel of its own, the attention scores it makes
        and the attention matmuls' share of the FLOPs; zeros without a trace. Only work that depends on the batch
        counts; the ops between an attention score matmul and the matmul that consumes its probabilities (scale,
        mask, softmax) are attention's, not elementwise work.

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from openhosti_jax.models.gpt import GPT, GPTConfig
        >>> cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=16, n_heads=2, n_layers=3)
        >>> w = workload(lambda r: GPT(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((4, 32), jnp.int32))
        >>> a = w.attention_work()
        >>> a.score_elements == 3 * 2 * 32 * 32, a.masked  # layers x heads x seq x seq, causal
        (True, True)
        """
        if self.jaxpr is None:
            return AttentionWork(0.0, 0.0, 0.0)

        def walk() -> AttentionWork:
            acc = {"bytes": 0.0, "scores": 0.0, "attention": 0.0, "all": 0.0, "masked": 0.0}
            n_params = len(jax.tree.leaves(unbox(self.params)))
            _attention_walk(self.jaxpr, 1.0, set(self.jaxpr.invars[n_params:]), acc)
            share = acc["attention"] / acc["all"] if acc["all"] else 0.0
            return AttentionWork(acc["bytes"], acc["scores"], share, bool(acc["masked"]))

        return self.memo(("attention",), walk)

    def tensor_split(self, param_dims: tuple[int | None, ...], t: int, sequence: bool = False) -> TensorSplit:
        """What splitting parameter leaf ``i`` over a tensor axis of size ``t`` along dim ``param_dims[i]``
        (None: replicated) does to the activations and matmuls; ``sequence``: the activations the split leaves
        whole are split along the sequence too (sequence parallelism), except those a split matmul consumes,
        which are all-gathered for it and kept so for the backward."""
        if self.jaxpr is None or t <= 1 or all(d is None for d in param_dims):
            return TensorSplit(
                self.activation_bytes_per_example / (t if sequence else 1), 0.0, 0.0, 0, self.loss_bytes_per_example
            )
        key = (param_dims, t, sequence)
        if key not in self._split_cache:
            in_dims = list(param_dims) + [None] * (len(self.jaxpr.invars) - len(param_dims))
            # one propagation serves the split with and without the sequence split
            dims, split_flops, reshard, cut, whole = self.memo(
                ("propagate", param_dims, t), lambda: propagate(self.jaxpr, in_dims, t)
            )
            saved = _saved(self.residuals, self.outputs)
            act = sum(
                leaf_bytes(v) / (t if dims.get(v) is not None or (sequence and v not in whole) else 1) for v in saved
            )
            total = count_flops(self.jaxpr, matmul_only=True)
            loss = 2 * sum(leaf_bytes(v) / (t if dims.get(v) is not None else 1) for v in self.outputs)
            self._split_cache[key] = TensorSplit(act, split_flops / total if total else 0.0, reshard, cut, loss)
        return self._split_cache[key]


class PolicyActivations(NamedTuple):
    """What a remat and precision policy does to one example (`Workload.policy_activations`)."""

    bytes_per_example: float
    """Activation bytes per example at the backward's peak."""
    flops_factor: float
    """Step FLOPs over the FLOPs without remat (recomputation)."""
    host_bytes_per_example: float = 0.0
    """Activation bytes per example moved to host memory and back (remat ``"offload"``)."""
    checkpointed_per_example: float | None = None
    """Of ``bytes_per_example``, what the policy keeps through the whole backward (the checkpointed values and the
    loss's), without the block being recomputed; None where the trace does not separate them (a user's step)."""


class ExpertWork(NamedTuple):
    """A forward pass's mixture-of-experts work per example (`Workload.experts`)."""

    num_experts: int
    """Routed experts per MoE layer (0: a dense model)."""
    layers: float
    """MoE layers the forward runs (dispatches into grouped matmuls)."""
    rows_per_example: float
    """Token-expert assignments per example, summed over the MoE layers (tokens x top-k per layer; in capacity
    mode the slots, experts x capacity): the rows an expert-parallel layer sends to the experts' devices and
    back."""
    width: int
    """Elements per dispatched row (the model width)."""
    share: float
    """The routed experts' matmuls' share of the matmul FLOPs (grouped, or in capacity mode batched over the
    experts)."""
    dispatch_bytes: float
    """Bytes the dispatch's gathers, scatters and sorts of activations (not of weights: an embedding lookup is no
    dispatch) read and write in the forward: memory traffic a dense MLP has none of."""
    grouped: bool = False
    """Dropless: the experts run as grouped matmuls over sorted rows (`jax.lax.ragged_dot`); False: capacity
    slots, a matmul batched over the experts."""


class AttentionWork(NamedTuple):
    """A forward pass's work besides the projections, per example (`Workload.attention_work`)."""

    elementwise_bytes: float
    """Bytes the batch-dependent elementwise and reduction ops read and write, each as its own kernel (views:
    reshapes and broadcasts, excluded), attention's score ops excluded."""
    score_elements: float
    """Attention score elements made (outputs of batched matmuls larger than both their operands)."""
    attention_share: float
    """The batched (attention) matmuls' share of the matmul FLOPs."""
    masked: bool = False
    """Whether the scores pass a fixed mask (one that does not depend on the batch, e.g. causal): a flash kernel
    skips the blocks it masks whole."""


_VIEWS = frozenset("reshape squeeze expand_dims broadcast_in_dim transpose slice".split())


def _attention_walk(
    jaxpr: Any, trips: float, batch: set[Any], acc: dict[str, float], scores: set[Any] | None = None
) -> None:
    """Add ``jaxpr``'s `AttentionWork` (run ``trips`` times; ``batch``: its values that depend on the batch;
    ``scores``: its values that are attention scores or made from them) to ``acc``."""
    scores = set() if scores is None else scores
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, Literal)]
        hit = [v in batch for v in ins]
        inner = calls(eqn, matmul_flops)
        if inner:
            for sub, n, operands, *_ in inner:
                if operands is not None:
                    pairs = [(v, o) for v, o in zip(sub.invars, operands, strict=True) if not isinstance(o, Literal)]
                    dep, inner_scores = {v for v, o in pairs if o in batch}, {v for v, o in pairs if o in scores}
                else:  # unknown mapping: every input is the batch's
                    dep, inner_scores = set(sub.invars), set()
                _attention_walk(sub, trips * n, dep, acc, inner_scores)
            if any(hit):
                batch.update(eqn.outvars)
            if any(v in scores for v in ins):
                scores.update(eqn.outvars)
            continue
        if not any(hit):
            continue
        batch.update(eqn.outvars)
        if eqn.primitive.name == "ragged_dot_general":  # grouped matmuls: projections, not attention
            acc["all"] += ragged_dot_flops(eqn) * trips
            continue
        if eqn.primitive.name == "dot_general":
            flops = dot_flops(eqn) * trips
            acc["all"] += flops
            (_, (lb, _)) = eqn.params["dimension_numbers"]
            if lb and all(v in batch for v in eqn.invars[:2]):  # not a capacity-mode expert matmul (weights rhs)
                acc["attention"] += flops
                out = eqn.outvars[0].aval.size
                if all(out >= getattr(v.aval, "size", 0) for v in ins):
                    acc["scores"] += out * trips
                    scores.update(eqn.outvars)
            continue
        if any(v in scores for v in ins):
            if eqn.primitive.name == "select_n" and eqn.invars[0] not in batch:  # a fixed (e.g. causal) mask
                acc["masked"] = 1.0
            scores.update(eqn.outvars)
            continue
        if eqn.primitive.name in _VIEWS:
            continue
        acc["bytes"] += trips * sum(leaf_bytes(v.aval) for v in (*ins, *eqn.outvars))


def _gemms(jaxpr: Any, trips: float, sizes: dict[tuple[float, bool], float], batched: bool | None = None) -> None:
    """Add each ``dot_general`` of ``jaxpr`` run ``trips`` times to ``sizes`` ((M N K of one call, False) -> FLOPs)
    and each grouped matmul (``ragged_dot_general``: no batch dims) as ((M N K of one group, True) -> FLOPs);
    ``batched``: only those with (True) or without (False) batch dims."""
    for eqn in jaxpr.eqns:
        inner = calls(eqn, matmul_flops)
        if inner:
            for c in inner:
                _gemms(c.jaxpr, trips * c.trips, sizes, batched)
        elif eqn.primitive.name == "dot_general":
            if batched is not None and bool(eqn.params["dimension_numbers"][1][0]) != batched:
                continue
            flops = dot_flops(eqn)
            sizes[(flops / 2, False)] = sizes.get((flops / 2, False), 0.0) + flops * trips
        elif eqn.primitive.name == "ragged_dot_general" and not batched:
            flops = ragged_dot_flops(eqn)
            key = (flops / 2 / ragged_groups(eqn), True)
            sizes[key] = sizes.get(key, 0.0) + flops * trips


_DISPATCH = frozenset("gather scatter scatter-add scatter_add sort".split())


def _expert_walk(jaxpr: Any, trips: float, batch: set[Any], derived: set[Any], acc: dict[str, float]) -> None:
    """Add ``jaxpr``'s grouped matmuls and dispatch traffic (run ``trips`` times) to ``acc``: a grouped matmul whose
    lhs is not made by elementwise ops from another one's output (``derived``: a SwiGLU's down projection) takes
    a dispatch of its lhs rows (counted once per lhs: gate and up share theirs); ``batch``: the values that depend
    on the batch, whose gathers, scatters and sorts are the dispatch's traffic."""
    dispatched: set[Any] = set()
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, Literal)]
        inner = calls(eqn, matmul_flops)
        if inner:
            for c in inner:
                if c.operands is not None:
                    pairs = [(v, o) for v, o in zip(c.jaxpr.invars, c.operands, strict=True)]
                    pairs = [(v, o) for v, o in pairs if not isinstance(o, Literal)]
                    dep, der = {v for v, o in pairs if o in batch}, {v for v, o in pairs if o in derived}
                else:
                    dep, der = set(c.jaxpr.invars), set()
                _expert_walk(c.jaxpr, trips * c.trips, dep, der, acc)
            if any(v in batch for v in ins):
                batch.update(eqn.outvars)
            continue
        name = eqn.primitive.name
        if any(v in batch for v in ins):
            batch.update(eqn.outvars)
            if name in _DISPATCH and eqn.invars[0] in batch:  # an embedding lookup reads a weight table instead
                acc["bytes"] += trips * sum(leaf_bytes(v.aval) for v in (*ins, *eqn.outvars) if v in batch)
        grouped = name == "ragged_dot_general" and eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
        # capacity mode: each expert's slots times its own weights, a matmul batched over the experts whose rhs
        # is a weight (attention's batched matmuls take two activations)
        slotted = (
            name == "dot_general"
            and eqn.params["dimension_numbers"][1][0]
            and eqn.invars[0] in batch
            and not isinstance(eqn.invars[1], Literal)
            and eqn.invars[1] not in batch
        )
        if grouped or slotted:
            acc["flops"] += (ragged_dot_flops(eqn) if grouped else dot_flops(eqn)) * trips
            acc["grouped"] += bool(grouped)
            lhs = eqn.invars[0]
            lc = (
                eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[0][0]
                if grouped
                else eqn.params["dimension_numbers"][0][0]
            )
            if lhs not in derived and lhs not in dispatched:
                dispatched.add(lhs)
                width = math.prod(lhs.aval.shape[d] for d in lc)
                acc["rows"] += trips * math.prod(lhs.aval.shape) / width
                acc["width"] = max(acc["width"], width)
                acc["layers"] += trips
            derived.update(eqn.outvars)
        elif name == "ragged_dot_general":
            acc["flops"] += ragged_dot_flops(eqn) * trips
            derived.update(eqn.outvars)
        elif name in _ELEMENTWISE and any(v in derived for v in ins):
            derived.update(eqn.outvars)


_PASS_THROUGH = frozenset("add convert_element_type reshape squeeze expand_dims broadcast_in_dim".split())


def _unkept_projection_flops(jaxpr: Any, inside: bool = False) -> float:
    """FLOPs of the matmuls without batch dims inside checkpointed calls of ``jaxpr`` whose outputs do not reach a
    value named `openhosti_jax.policies.remat.KEEP_NAME` (through adds, casts and reshapes): what remat
    ``"selective"`` computes again in the backward (a scan body's once per trip)."""
    total = 0.0
    origin: dict[Any, Any] = {}  # value -> the projection it was made from
    kept: set[Any] = set()
    flops: dict[Any, float] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inner = calls(eqn, matmul_flops)
        if inner:
            into = inside or is_remat(eqn)
            total += sum(c.trips * _unkept_projection_flops(c.jaxpr, into) for c in inner)
            continue
        if name == "dot_general" and inside and not eqn.params["dimension_numbers"][1][0]:
            origin[eqn.outvars[0]] = eqn
            flops[eqn] = dot_flops(eqn)
        elif name == "name" and eqn.params.get("name") == KEEP_NAME:
            kept.update(origin[v] for v in eqn.invars if not isinstance(v, Literal) and v in origin)
        elif name in _PASS_THROUGH:
            made = [origin[v] for v in eqn.invars if not isinstance(v, Literal) and v in origin]
            if len(made) == 1:
                origin.update(dict.fromkeys(eqn.outvars, made[0]))
    return total + sum(f for eqn, f in flops.items() if eqn not in kept)


def remat_blocks(jaxpr: Any) -> int:
    """How many checkpointed blocks ``jaxpr`` calls: each ``remat`` equation with matmuls inside, counted through
    nested calls by the rule of `openhosti_jax.jaxpr_walk` (times the length of the scans around it; of a
    ``cond``, the branch the planner prices, the one with the most matmul FLOPs). A checkpointed call without
    matmuls is an activation or a norm that keeps only its inputs (`openhosti_jax.models.elementwise`), not a
    block a remat policy recomputes."""
    total = 0
    for eqn in jaxpr.eqns:
        if is_remat(eqn):
            total += any(count_flops(j, matmul_only=True) for j in nested_jaxprs(eqn))
            continue
        total += sum(c.trips * remat_blocks(c.jaxpr) for c in calls(eqn, matmul_flops))
    return total


class TensorSplit(NamedTuple):
    """A tensor split's effect on one example (`Workload.tensor_split`)."""

    activation_bytes: float
    """Activation bytes per example per device."""
    split_share: float
    """Fraction of matmul FLOPs computed split."""
    resharded: float
    """Bytes per example gathered forward and reduce-scattered backward (marks the ops cannot carry)."""
    cut_reshapes: int
    """Reshapes that cut the split dim into parts the axis does not divide (e.g. heads): the split is unusable."""
    loss_bytes: float = 0.0
    """Of ``activation_bytes``, what the loss holds per example per device: two copies of the model's outputs
    (`Workload.loss_bytes_per_example`), split where the outputs are."""


def _batch_size(batch: Any) -> int:
    """The batch size by the library's one rule (`openhosti_jax.sharding.batch.batch_size`: PRNG keys and leaves
    without the batch's leading dimension are not batch data)."""
    n = batch_size(batch)
    if n is None:
        found = sorted({f"{x.dtype}{list(x.shape)}" for x in jax.tree.leaves(batch)}) or ["no leaves"]
        raise BatchError(
            f"expected a batch with at least one array leaf of shape [batch, ...] that is not a PRNG key, found "
            f"{', '.join(found)}; pass the step's data as arrays whose leading dimension is the batch"
        )
    return n


def _resize(batch: Any, n: int) -> Any:
    """``batch`` at batch size ``n``: its batch leaves resized, and a batch of keys with one key per row
    (`openhosti_jax.sharding.batch.per_row_keys`); every other leaf (a key, tables, scalars) kept."""
    leaves, treedef = jax.tree.flatten(batch)
    rows = batch_size(batch)
    flags = [f or per_row_keys(x, rows) for x, f in zip(leaves, batch_leaves(batch), strict=True)]
    return treedef.unflatten(
        [jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype) if f else x for x, f in zip(leaves, flags, strict=True)]
    )


def _first_batch_leaf(batch: Any) -> Any:
    return next(x for x, f in zip(jax.tree.leaves(batch), batch_leaves(batch), strict=True) if f)


def _per_example_residuals(jaxpr: Any, n_params: int, n_outputs: int) -> tuple[Any, ...]:
    """Saved values that depend on the batch and that XLA materialises (not recomputed inside a fusion), from a
    trace of ``(outputs, vjp residuals)``: the first ``n_outputs`` out-values are the model's outputs, which
    `_saved` counts, so they are not residuals too."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    depends = set(jaxpr.invars[n_params:])
    for eqn in jaxpr.eqns:
        if any(not isinstance(i, Literal) and i in depends for i in eqn.invars):
            depends.update(eqn.outvars)
    outs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    available = outs | set(jaxpr.invars)
    kept = []
    outputs = set(jaxpr.outvars[:n_outputs])
    for v in dict.fromkeys(v for v in jaxpr.outvars[n_outputs:] if not isinstance(v, Literal)):
        if v in jaxpr.invars or v in outputs or v not in depends:
            continue
        eqn = producer.get(v)
        fusible = (
            eqn is not None
            and eqn.primitive.name in _ELEMENTWISE
            and all(
                isinstance(i, Literal)
                or i in available
                or (i in producer and producer[i].primitive.name in ("broadcast_in_dim", "iota"))
                for i in eqn.invars
            )
        )
        if not fusible:
            kept.append(v)
    return tuple(kept)


def _saved(residuals: tuple[Any, ...], outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The values a training step keeps per example: the model's residuals, and each output twice (the loss on
    it keeps one output-sized residual, e.g. its softmax, and makes the output's cotangent)."""
    return residuals + outputs + outputs


def _positions(output: Any, batch: Any) -> int:
    """Positions per example: the middle dims of a model's output ``(batch, *positions, features)``; for an output
    without them (a sequence classifier's ``(batch, classes)``), the most positions an integer input leaf (token ids
    ``(batch, *positions)``) holds, since its layers ran on every one of them; else 1."""
    if output.ndim >= 3:
        return math.prod(output.shape[1:-1])
    leaves = [x for x, f in zip(jax.tree.leaves(batch), batch_leaves(batch), strict=True) if f]
    ids = [math.prod(x.shape[1:]) for x in leaves if x.ndim >= 2 and np.issubdtype(x.dtype, np.integer)]
    return max(ids, default=1)


def _forward_vjp(apply_fn: ApplyFn, model_state: Any) -> Any:
    def fwd(p: Any, x: Any) -> Any:
        out, vjp = jax.vjp(lambda q: apply_fn(q, x, model_state=model_state), p)
        return out, jax.tree.leaves(vjp)

    return fwd


def measure(params: Any, model_state: Any, apply_fn: ApplyFn | None, batch: Any) -> Workload:
    """The `Workload` of abstract ``params`` run by ``apply_fn`` on an abstract global ``batch``.

    One trace of the forward pass and its VJP at batch size 1: every batch-dependent residual is per example.
    """
    batch = abstract(batch)
    n = _batch_size(batch)
    if apply_fn is None:
        return Workload(params, model_state, None, batch, n, 0.0, 0.0, 1)
    plain = unbox(params)

    one, shapes = jax.make_jaxpr(_forward_vjp(apply_fn, model_state), return_shape=True)(plain, _resize(batch, 1))
    n_params = len(jax.tree.leaves(plain))
    n_out = len(jax.tree.leaves(shapes[0]))
    residuals = _per_example_residuals(one.jaxpr, n_params, n_out)
    outputs = tuple(v for v in one.jaxpr.outvars[:n_out] if not isinstance(v, Literal))
    first = one.out_avals[0]
    tokens = _positions(first, batch)
    flops = 3.0 * count_flops(one.jaxpr, matmul_only=True)
    act = sum(leaf_bytes(v) for v in _saved(residuals, outputs))
    return Workload(
        params,
        model_state,
        apply_fn,
        batch,
        n,
        flops,
        act,
        tokens,
        first.dtype.itemsize,
        one.jaxpr,
        residuals,
        outputs,
    )


def _live_bytes(jaxpr: Any) -> list[float]:
    """Bytes of the values the program has made and still needs, after each equation in program order (nested
    jaxprs count as one equation: their outputs are live, their temporaries are not)."""
    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            last_use[v] = len(jaxpr.eqns)
    live, dying, out = 0.0, {}, []
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            if v in last_use:
                live += leaf_bytes(v)
                dying[last_use[v]] = dying.get(last_use[v], 0.0) + leaf_bytes(v)
        out.append(live)
        live -= dying.pop(i, 0.0)
    return out


def measure_step(step_fn: Any, state: Any, batch: Any, params: Any, layout: Any = None) -> Workload:
    """The `Workload` of a user's ``step_fn(state, batch)`` with no apply function, from traces of the whole step
    at batch sizes 1 and 2: its matmul FLOPs per example (forward and backward already), and its activations per
    example, the most that one more example adds to the bytes alive at any point of the program (what does not
    grow with the batch, the gradient and the updates, cancels).

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> params, tx = {"w": jnp.ones((16, 16))}, optax.sgd(0.1)
        >>> def step(state, x):
        ...     p, o = state
        ...     g = jax.grad(lambda q: jnp.sum(jnp.tanh(x @ q["w"])))(p)
        ...     u, o = tx.update(g, o, p)
        ...     return (optax.apply_updates(p, u), o), {}
        >>> w = measure_step(step, (params, tx.init(params)), jax.ShapeDtypeStruct((8, 16), jnp.float32), params)
        >>> w.flops_per_example  # x @ w forward, and the weight gradient x^T @ dy
        1024.0
    """
    batch = abstract(batch)
    n = _batch_size(batch)
    one, two = (jax.make_jaxpr(step_fn)(state, _resize(batch, k)).jaxpr for k in (1, 2))
    flops = count_flops(one, matmul_only=True)
    first = _first_batch_leaf(batch)
    tokens = math.prod(first.shape[1:-1]) if first.ndim >= 3 else 1
    return Workload(
        params, None, None, batch, n, flops, _growth(one, two), tokens, state=state, layout=layout, step_fn=step_fn
    )


def _growth(one: Any, two: Any) -> float:
    """The most that one more example adds to the bytes alive at any point, from traces at batch 1 and 2."""
    live_one, live_two = _live_bytes(one), _live_bytes(two)
    if len(live_one) == len(live_two):
        return max((b - a for a, b in zip(live_one, live_two, strict=True)), default=0.0)
    return max(live_two, default=0.0) / 2


def workload(model: Any, sample_batch: Any, *, apply_fn: ApplyFn | None = None) -> Workload:
    """The `Workload` of ``model`` on ``sample_batch`` (arrays or `jax.ShapeDtypeStruct`, global batch)."""
    batch = abstract(sample_batch)
    parts = model_parts(model, batch, apply_fn=apply_fn)
    return measure(parts.params, parts.model_state, parts.apply_fn, batch)
