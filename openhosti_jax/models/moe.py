"""A mixture-of-experts MLP block (Flax nnx): top-k router, SwiGLU experts, dropless or capacity dispatch, and
expert parallelism over an ``expert`` mesh axis with ``jax.lax.all_to_all``.

Each token's router softmax picks its ``top_k`` experts, whose outputs are summed with the picked probabilities
renormalised to one (Mixtral). Dropless mode sorts the token-expert assignments by expert and runs every expert in
one grouped matmul (`jax.lax.ragged_dot`); capacity mode gives each expert ``ceil(capacity_factor * tokens * top_k /
num_experts)`` slots, filled first come first served in token order, and a token an expert has no slot for gets
nothing from that expert. `expert_parallel` runs the same block with the experts split over an ``expert`` mesh
axis and the tokens over ``data`` x ``expert``; it computes the same numbers as one device.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.models.moe import MoEBlock, MoEConfig
    >>> cfg = MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2)
    >>> block = MoEBlock(cfg, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    >>> y, aux = block(x)
    >>> y.shape, int(aux.expert_counts.sum()), float(aux.dropped_fraction)
    ((2, 8, 16), 32, 0.0)
    >>> mesh = jax.make_mesh((1,), ("expert",))
    >>> y_ep, _ = block(x, mesh=mesh, data_axis=None)
    >>> bool(jnp.allclose(y, y_ep, atol=1e-6))
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import BatchError, ConfigError, ShardingError
from openhosti_jax.mesh.config import BATCH_AXES, EXPERT_AXIS
from openhosti_jax.models.checks import dtype_problem, finite_number, positive_ints
from openhosti_jax.models.elementwise import recomputed, swiglu
from openhosti_jax.state.context import current_token_axes

_POSITIVE_INTS = ("d_model", "d_ff", "num_experts", "top_k")
_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
_SHARED_WEIGHTS = ("shared_gate", "shared_up", "shared_down")
TENSOR_AXIS = "tensor"
"""The axis `moe_layer` splits the experts' hidden width over, where the mesh has it."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of the block."""

    d_model: int
    """Residual width (input and output)."""
    d_ff: int
    """SwiGLU hidden width of each expert."""
    num_experts: int
    """Routed experts."""
    top_k: int
    """Experts each token is sent to (at most ``num_experts``)."""
    num_shared_experts: int = 0
    """Experts every token goes through, unrouted and unweighted (DeepSeekMoE); run as one SwiGLU of width
    ``num_shared_experts * d_ff``, which is the sum of that many ``d_ff`` experts."""
    capacity_factor: float | None = None
    """None: dropless. Else each expert takes at most ``ceil(capacity_factor * tokens * top_k / num_experts)``
    assignments per call, in token order; the rest are dropped."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss in `MoEAux.loss`."""
    router_z_loss_weight: float = 0.0
    """Weight of the router z-loss in `MoEAux.loss` (ST-MoE uses 1e-3)."""
    dtype: str = "float32"
    """Compute dtype of the experts (parameters stay float32; the router runs in float32)."""

    def __post_init__(self) -> None:
        bad, problems = positive_ints({k: getattr(self, k) for k in _POSITIVE_INTS}, _POSITIVE_INTS)
        if not bad & {"num_experts", "top_k"} and self.top_k > self.num_experts:
            problems.append(f"top_k={self.top_k} must be at most num_experts={self.num_experts}")
        s = self.num_shared_experts
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            problems.append(f"num_shared_experts={s!r} must be an int >= 0")
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c <= 0):
            problems.append(f"capacity_factor={c!r} must be a positive finite number or None (dropless)")
        problems += [
            p
            for k in ("aux_loss_weight", "router_z_loss_weight")
            if (p := finite_number(k, getattr(self, k), minimum=0, strict=False))
        ]
        problems += [p for p in [dtype_problem(self.dtype)] if p]
        if problems:
            raise ConfigError("invalid MoEConfig: " + "; ".join(problems))

    def capacity(self, tokens: int) -> int | None:
        """Slots per expert for a call on ``tokens`` tokens (None when dropless), capped at ``tokens``: an expert
        never gets more than one assignment per token."""
        if self.capacity_factor is None:
            return None
        return min(tokens, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))


class MoEAux(NamedTuple):
    """What the block reports besides its output (scalars are float32, over every token of the call)."""

    loss: jax.Array
    """``aux_loss_weight * load_balance_loss + router_z_loss_weight * router_z_loss``: add it to the model loss."""
    load_balance_loss: jax.Array
    """Switch/GShard ``num_experts * sum_e f_e * p_e``: ``f_e`` the share of the ``tokens * top_k`` assignments
    routed to expert ``e`` (before any drop), ``p_e`` its mean router probability; 1 when perfectly balanced."""
    router_z_loss: jax.Array
    """ST-MoE z-loss: the mean over tokens of ``logsumexp(router logits) ** 2``."""
    expert_counts: jax.Array
    """int32 ``(num_experts,)``: assignments routed to each expert, before any drop."""
    dropped_fraction: jax.Array
    """Share of the ``tokens * top_k`` assignments dropped for lack of capacity (0 when dropless)."""


class Routing(NamedTuple):
    """The router's decision for ``T`` tokens (`route`)."""

    logits: jax.Array
    """float32 ``(T, num_experts)``."""
    probs: jax.Array
    """float32 ``(T, num_experts)``: softmax of the logits."""
    experts: jax.Array
    """int32 ``(T, top_k)``: each token's experts, most probable first."""
    weights: jax.Array
    """float32 ``(T, top_k)``: their probabilities renormalised to sum to one per token."""
    position: jax.Array
    """int32 ``(T, top_k)``: how many earlier tokens of the call went to the same expert (its slot)."""
    kept: jax.Array
    """bool ``(T, top_k)``: the assignment has a slot (``position < capacity``; all True when dropless)."""


def route(cfg: MoEConfig, router: jax.Array, x: jax.Array) -> Routing:
    """Route tokens ``x`` ``(T, d_model)`` with the router kernel ``(d_model, num_experts)``, on one device."""
    r, _ = _route_local(cfg, router, x)
    c = cfg.capacity(x.shape[0])
    return r if c is None else r._replace(kept=r.position < c)


def moe_metrics(aux: MoEAux | None) -> dict[str, jax.Array]:
    """A train step's scalar metrics from the MoE layers' `MoEAux` stacked over ``layers`` (as a model's
    ``with_aux=True`` call returns it; ``{}`` for None): ``moe_aux_loss`` (their losses summed),
    ``moe_dropped_fraction`` (of all layers' assignments), ``moe_imbalance`` (the most loaded expert's assignments
    over the mean, in the worst layer: 1 when balanced) and ``moe_tokens/e{i}`` (assignments routed to expert ``i``
    before any drop, summed over the layers); `openhosti_jax.report` plots the last three.

    >>> aux = MoEAux(*(jnp.zeros((2,)),) * 3, jnp.array([[3, 1], [2, 2]]), jnp.array([0.25, 0.0]))
    >>> {k: float(v) for k, v in moe_metrics(aux).items()}  # doctest: +NORMALIZE_WHITESPACE
    {'moe_aux_loss': 0.0, 'moe_dropped_fraction': 0.125, 'moe_imbalance': 1.5, 'moe_tokens/e0': 5.0,
     'moe_tokens/e1': 3.0}
    """
    if aux is None:
        return {}
    counts = aux.expert_counts.astype(jnp.float32)
    out = {
        "moe_aux_loss": jnp.sum(aux.loss),
        "moe_dropped_fraction": jnp.mean(aux.dropped_fraction),
        "moe_imbalance": jnp.max(jnp.max(counts, axis=-1) / jnp.mean(counts, axis=-1)),
    }
    total = jnp.sum(aux.expert_counts, axis=0)
    return out | {f"{EXPERT_TOKENS}{i}": total[i] for i in range(total.shape[0])}


EXPERT_TOKENS = "moe_tokens/e"
"""The prefix of `moe_metrics`' per-expert token counts (``moe_tokens/e0``, ...)."""


def _route_local(cfg: MoEConfig, router: jax.Array, x: jax.Array) -> tuple[Routing, jax.Array]:
    """(routing with positions among these tokens, kept all True; int32 counts per expert)."""
    e, k = cfg.num_experts, cfg.top_k
    logits = recomputed(lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32))(x, router)  # no float32 copy kept
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_e = jax.lax.top_k(probs, k)
    weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    flat = top_e.reshape(-1)
    counts = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    order = jnp.argsort(flat, stable=True)  # by expert, token order within an expert
    starts = jnp.cumsum(counts) - counts
    pos_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[flat[order]]
    position = jnp.zeros_like(flat).at[order].set(pos_sorted).reshape(top_e.shape)
    kept = jnp.ones(top_e.shape, bool)
    return Routing(logits, probs, top_e.astype(jnp.int32), weights, position, kept), counts


def _swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    return swiglu(x @ gate, x @ up) @ down


def _experts_batched(h: jax.Array, w: dict[str, jax.Array], dt: jnp.dtype) -> jax.Array:
    """Each expert's SwiGLU on its own rows: ``h`` ``(E, rows, d_model)``, weights ``(E, ...)``."""
    g, u, d = (w[n].astype(dt) for n in _EXPERT_WEIGHTS)
    a = swiglu(jnp.einsum("erd,edf->erf", h, g), jnp.einsum("erd,edf->erf", h, u))
    return jnp.einsum("erf,efd->erd", a, d)


def _experts_grouped(h: jax.Array, sizes: jax.Array, w: dict[str, jax.Array], dt: jnp.dtype) -> jax.Array:
    """Experts' SwiGLU on rows ``h`` ``(rows, d_model)`` sorted by expert, ``sizes[e]`` rows each (rows past
    ``sum(sizes)`` come out zero)."""
    g, u, d = (w[n].astype(dt) for n in _EXPERT_WEIGHTS)
    a = swiglu(jax.lax.ragged_dot(h, g, sizes), jax.lax.ragged_dot(h, u, sizes))
    return jax.lax.ragged_dot(a, d, sizes)


def _combine(cfg: MoEConfig, w: dict[str, jax.Array], x: jax.Array, r: Routing, per_assignment: jax.Array) -> jax.Array:
    """Weighted sum of each token's expert outputs ``(T * top_k, d_model)``, plus the shared experts."""
    t, d = x.shape
    weigh = recomputed(lambda w, p: jnp.einsum("tk,tkd->td", w, p.astype(jnp.float32)))  # no float32 copy kept
    y = weigh(r.weights, per_assignment.reshape(t, cfg.top_k, d))
    if cfg.num_shared_experts:
        dt = jnp.dtype(cfg.dtype)
        y = y + _swiglu(x.astype(dt), *(w[n].astype(dt) for n in _SHARED_WEIGHTS)).astype(jnp.float32)
    return y.astype(x.dtype)


def _aux(
    cfg: MoEConfig,
    r: Routing,
    counts: jax.Array,
    dropped: jax.Array,
    psum: Callable[[jax.Array], jax.Array],
    tokens: int,
) -> MoEAux:
    """Aux losses and metrics over all ``tokens`` of the call; ``psum`` sums a local statistic over the token
    shards (the identity on one device)."""
    counts = psum(counts)
    p_mean = psum(jnp.sum(r.probs, axis=0)) / tokens
    f = counts.astype(jnp.float32) / (tokens * cfg.top_k)
    balance = cfg.num_experts * jnp.sum(f * p_mean)
    z = psum(jnp.sum(jnp.square(jax.nn.logsumexp(r.logits, axis=-1)))) / tokens
    frac = psum(dropped).astype(jnp.float32) / (tokens * cfg.top_k)
    loss = cfg.aux_loss_weight * balance + cfg.router_z_loss_weight * z
    return MoEAux(loss, balance, z, counts, frac)


def _dispatch_buffer(x: jax.Array, r: Routing, experts: int, slots: int) -> jax.Array:
    """``(experts, slots, d_model)``: each kept assignment's token at slot ``r.position`` of its expert, the rest
    zero."""
    t, d = x.shape
    flat = jnp.where(r.kept, r.experts * slots + r.position, experts * slots).reshape(-1)  # dropped: a spare row
    tok = jnp.repeat(jnp.arange(t), r.experts.shape[1])
    buf = jnp.zeros((experts * slots + 1, d), x.dtype).at[flat].set(x[tok])
    return buf[:-1].reshape(experts, slots, d)


def _gather_buffer(out: jax.Array, r: Routing) -> jax.Array:
    """``(T * top_k, d_model)``: each assignment's row of the expert outputs ``out`` ``(E, slots, d)``, zero
    where dropped."""
    e, s, d = out.shape
    flat = jnp.where(r.kept, r.experts * s + r.position, e * s).reshape(-1)
    return jnp.concatenate([out.reshape(e * s, d), jnp.zeros((1, d), out.dtype)])[flat]


def moe_forward(cfg: MoEConfig, w: dict[str, jax.Array], x: jax.Array) -> tuple[jax.Array, MoEAux]:
    """The block on one device: ``(y, aux)`` for ``x`` ``(..., d_model)``, weights ``w`` as `MoEBlock.weights`."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    t = xt.shape[0]
    dt = jnp.dtype(cfg.dtype)
    r, counts = _route_local(cfg, w["router"], xt)
    c = cfg.capacity(t)
    if c is None:
        flat = r.experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tok = jnp.repeat(jnp.arange(t), cfg.top_k)
        out_sorted = _experts_grouped(xt[tok[order]].astype(dt), counts, w, dt)
        per = out_sorted[jnp.argsort(order)]
        dropped = jnp.zeros((), jnp.int32)
    else:
        r = r._replace(kept=r.position < c)
        buf = _dispatch_buffer(xt.astype(dt), r, cfg.num_experts, c)
        per = _gather_buffer(_experts_batched(buf, w, dt), r)
        dropped = jnp.sum(~r.kept).astype(jnp.int32)
    y = _combine(cfg, w, xt, r, per)
    return y.reshape(shape), _aux(cfg, r, counts, dropped, lambda v: v, t)


def _ep_local(
    w: dict[str, jax.Array],
    x: jax.Array,
    *,
    cfg: MoEConfig,
    expert_axis: str | None,
    token_axes: tuple[str, ...],
    tensor_axis: str | None,
    n_ep: int,
    tokens: int,
) -> tuple[jax.Array, MoEAux]:
    """One device's part of `expert_parallel`: route the local tokens, send each assignment to the device holding
    its expert (all_to_all over ``expert_axis``; None: ``n_ep`` is 1 and every expert is local), run the local
    experts, send the outputs back, combine."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    t, d = xt.shape
    e, k, dt = cfg.num_experts, cfg.top_k, jnp.dtype(cfg.dtype)
    e_local = e // n_ep
    r, counts = _route_local(cfg, w["router"], xt)
    c = cfg.capacity(tokens)

    def exchange(v: jax.Array) -> jax.Array:
        return v if expert_axis is None else jax.lax.all_to_all(v, expert_axis, 0, 0)

    if c is None:
        # Dropless: send every assignment; buffers are sized for the worst case (all to one device).
        a = t * k
        flat = r.experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sorted_e = flat[order]
        dest = sorted_e // e_local
        dest_counts = counts.reshape(n_ep, e_local)
        dest_start = jnp.cumsum(dest_counts.sum(1)) - dest_counts.sum(1)
        row = jnp.arange(a) - dest_start[dest]
        tok = jnp.repeat(jnp.arange(t), k)[order]
        send = jnp.zeros((n_ep, a, d), dt).at[dest, row].set(xt[tok].astype(dt))
        recv = exchange(send).reshape(n_ep * a, d)  # rows from source s, sorted by expert
        recv_counts = exchange(dest_counts)  # (n_ep sources, e_local)
        ends = jnp.cumsum(recv_counts, axis=1)
        local_e = jnp.sum(jnp.arange(a)[None, :, None] >= ends[:, None, :], axis=-1).reshape(-1)  # e_local: pad
        by_expert = jnp.argsort(local_e, stable=True)
        out = _experts_grouped(recv[by_expert], recv_counts.sum(0), w, dt)[jnp.argsort(by_expert)]
        back = exchange(out.reshape(n_ep, a, d))
        per = jnp.zeros((a, d), dt).at[order].set(back[dest, row])
        dropped = jnp.zeros((), jnp.int32)
    else:
        # Capacity: an assignment's slot is its position among all tokens of the call (earlier shards first).
        all_counts = jax.lax.all_gather(counts, token_axes)  # (shards, e), in token order
        me = jax.lax.axis_index(token_axes)
        offset = (jnp.cumsum(all_counts, axis=0) - all_counts)[me]
        r = r._replace(kept=r.position + offset[r.experts] < c)
        slots = min(c, t)  # one shard sends an expert at most one assignment per local token
        buf = _dispatch_buffer(xt.astype(dt), r, e, slots).reshape(n_ep, e_local, slots, d)
        recv = exchange(buf).transpose(1, 0, 2, 3).reshape(e_local, n_ep * slots, d)
        out = _experts_batched(recv, w, dt).reshape(e_local, n_ep, slots, d).transpose(1, 0, 2, 3)
        per = _gather_buffer(exchange(out).reshape(e, slots, d), r)
        dropped = jnp.sum(~r.kept).astype(jnp.int32)
    y = _combine(cfg, w, xt, r, per)
    if tensor_axis is not None:  # each tensor rank holds a slice of every hidden width: its outputs are partial
        y = jax.lax.psum(y, tensor_axis)
    aux = _aux(cfg, r, counts, dropped, lambda v: jax.lax.psum(v, token_axes), tokens)
    return y.reshape(shape), aux


def expert_parallel(
    cfg: MoEConfig,
    w: dict[str, jax.Array],
    x: jax.Array,
    mesh: Mesh | AbstractMesh,
    *,
    expert_axis: str = "expert",
    data_axis: str | Sequence[str] | None = "data",
    tensor_axis: str | None = None,
) -> tuple[jax.Array, MoEAux]:
    """The block with its experts split over ``mesh``'s ``expert_axis`` under `jax.shard_map`: equal to
    `moe_forward` (the same tokens dropped in capacity mode), as ``(y, aux)``.

    ``x`` ``(batch, ..., d_model)`` is split on ``batch`` over ``data_axis`` (one axis or several) x
    ``expert_axis`` (``data_axis=None``: ``expert_axis`` alone); the routed experts' weights over ``expert_axis``
    (replicated over ``data_axis``), the router and shared experts replicated. With ``tensor_axis`` (an axis of
    ``mesh`` larger than 1 that divides ``d_ff`` and the shared width) each expert's hidden width is split over it
    too, Megatron style, and the output summed over it once (`jax.lax.psum`); other axes of ``mesh`` compute the
    block redundantly. Tokens go to their experts' devices and back by two `jax.lax.all_to_all` over
    ``expert_axis``. Dropless exchanges are padded to the worst case (every local assignment bound for one device):
    each device receives ``expert`` x its local assignments' rows. In capacity mode the capacity is the whole
    call's, as on one device: an all-gather of the per-expert counts gives each assignment its slot among all
    tokens (shards in token order), so the same assignments are dropped, and each device sends
    ``min(capacity, local tokens)`` slots per expert. The aux losses and metrics are summed over the token shards.
    ``mesh`` may be the ambient abstract mesh (`jax.sharding.get_abstract_mesh`); axes already manual there are
    left alone. On `jax.sharding.AxisType.Explicit` axes the inputs are resharded to these specs and ``y`` back to
    ``x``'s.
    """
    names = mesh.axis_names
    sizes = dict(mesh.shape)
    if expert_axis not in names:
        raise ShardingError(f"expected an expert axis {expert_axis!r} in the mesh, found axes {names}")
    data_axes = () if data_axis is None else (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    missing = [a for a in data_axes if a not in names]
    if missing:
        raise ShardingError(
            f"expected data axes {missing} in the mesh, found axes {names}; pass data_axis=None to split the "
            "tokens over the expert axis alone"
        )
    n_ep = _expert_ways(cfg, int(sizes[expert_axis]), expert_axis)
    token_axes = (*data_axes, expert_axis)
    shards = math.prod(int(sizes[a]) for a in token_axes)
    if x.ndim < 2 or x.shape[-1] != cfg.d_model or x.shape[0] % shards:
        raise BatchError(
            f"expected x (batch, ..., d_model={cfg.d_model}) with batch divisible by {shards} "
            f"({' x '.join(token_axes)}), found shape {tuple(x.shape)}"
        )
    t_ax = tensor_axis if _splits_hidden(cfg, sizes, tensor_axis) else None
    specs = {n: _weight_spec(n, expert_axis, t_ax) for n in w}
    x_spec = P(token_axes)
    manual = set(getattr(mesh, "manual_axes", ()))
    free = [a for a in names if a not in manual]
    types = dict(zip(names, mesh.axis_types, strict=True))
    explicit = any(types[a] == AxisType.Explicit for a in free)
    if explicit:  # shard_map then wants its inputs placed as specified; y goes back to x's placement
        x_placed = jax.typeof(x).sharding.spec
        w = {n: jax.reshard(v, NamedSharding(mesh, specs[n])) for n, v in w.items()}
        x = jax.reshard(x, NamedSharding(mesh, x_spec))
    local = functools.partial(
        _ep_local,
        cfg=cfg,
        expert_axis=expert_axis,
        token_axes=token_axes,
        tensor_axis=t_ax,
        n_ep=n_ep,
        tokens=math.prod(x.shape[:-1]),
    )
    aux_spec = MoEAux(*(P(),) * len(MoEAux._fields))
    y, aux = jax.shard_map(
        local, mesh=mesh, in_specs=(specs, x_spec), out_specs=(x_spec, aux_spec), axis_names=set(free)
    )(w, x)
    return (jax.reshard(y, NamedSharding(mesh, x_placed)) if explicit else y), aux


def _expert_ways(cfg: MoEConfig, n_ep: int, expert_axis: str) -> int:
    """``n_ep``, the devices the experts split over, if it divides ``num_experts``; else `ShardingError`."""
    if cfg.num_experts % n_ep:
        raise ShardingError(
            f"the {expert_axis!r} axis has size {n_ep}, which does not divide num_experts={cfg.num_experts}; use a "
            f"mesh whose {expert_axis!r} size divides it"
        )
    return n_ep


def _splits_hidden(cfg: MoEConfig, sizes: dict[str, int], tensor_axis: str | None) -> bool:
    """Whether `expert_parallel` splits the experts' hidden width over ``tensor_axis``."""
    if tensor_axis is None or int(sizes.get(tensor_axis, 1)) <= 1:
        return False
    t = int(sizes[tensor_axis])
    return cfg.d_ff % t == 0 and (cfg.num_shared_experts * cfg.d_ff) % t == 0


def _weight_spec(name: str, expert_axis: str, tensor_axis: str | None) -> P:
    """A weight's spec inside `expert_parallel`: routed experts over ``expert_axis``, hidden widths over
    ``tensor_axis`` (None: unsplit), the router replicated."""
    return {
        "w_gate": P(expert_axis, None, tensor_axis),
        "w_up": P(expert_axis, None, tensor_axis),
        "w_down": P(expert_axis, tensor_axis, None),
        "shared_gate": P(None, tensor_axis),
        "shared_up": P(None, tensor_axis),
        "shared_down": P(tensor_axis, None),
    }.get(name, P())


def moe_layer(
    cfg: MoEConfig, w: dict[str, jax.Array], x: jax.Array, mesh: Mesh | AbstractMesh | None = None
) -> tuple[jax.Array, MoEAux]:
    """The block as a model runs it: under a mesh (default: the ambient one, `jax.set_mesh`) with an ``expert``
    axis, `expert_parallel` with the tokens over the mesh's data-parallel axes that divide the batch and
    ``expert``, and the experts' hidden width over ``tensor`` where it divides; inside a `jax.shard_map` whose manual
    axes `openhosti_jax.state.context.active_token_axes` names (a pipeline stage), `_ep_local` over them (one call
    routes every shard's rows; each ``expert`` rank runs its own experts when it is one of them: the weights it is
    given where they hold ``num_experts / expert``, else its slice of the whole); else `moe_forward`.

    >>> import jax, numpy as np
    >>> cfg = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2)
    >>> w = MoEBlock(cfg, rngs=nnx.Rngs(0)).weights()
    >>> x = jax.numpy.asarray(np.random.default_rng(0).normal(size=(8, 4, 8)), jax.numpy.float32)
    >>> mesh = jax.make_mesh((2, 4), ("data", "expert"))
    >>> with jax.set_mesh(mesh):
    ...     y, aux = jax.jit(moe_layer, static_argnums=0)(cfg, w, x)
    >>> y1, aux1 = moe_forward(cfg, w, x)
    >>> bool(jax.numpy.allclose(y, y1, atol=1e-6)), aux.expert_counts.tolist() == aux1.expert_counts.tolist()
    (True, True)
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    manual = set(getattr(mesh, "manual_axes", ()))
    shards = current_token_axes()
    if shards and not mesh.empty and set(shards) <= manual:
        return _manual_call(cfg, w, x, dict(mesh.shape), shards)
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or EXPERT_AXIS in manual:
        return moe_forward(cfg, w, x)
    sizes = dict(mesh.shape)
    rows, ways = [], 1
    for a in BATCH_AXES:
        n = int(sizes.get(a, 1))
        if a in sizes and a not in manual and n > 1 and x.shape[0] % (ways * n) == 0:
            rows.append(a)
            ways *= n
    tensor = TENSOR_AXIS if TENSOR_AXIS in sizes and TENSOR_AXIS not in manual else None
    return expert_parallel(cfg, w, x, mesh, expert_axis=EXPERT_AXIS, data_axis=rows, tensor_axis=tensor)


def _manual_call(
    cfg: MoEConfig, w: dict[str, jax.Array], x: jax.Array, sizes: dict[str, int], token_axes: tuple[str, ...]
) -> tuple[jax.Array, MoEAux]:
    """The block traced inside a `jax.shard_map` whose manual ``token_axes`` split the call's rows
    (`openhosti_jax.state.context.active_token_axes`: a pipeline stage): `_ep_local` on this device's rows, the
    experts split over ``expert`` where it is one of ``token_axes`` (each device runs its own experts: the weights
    it is given when they hold ``num_experts / expert`` of them, as a stage whose state splits them over ``expert``
    passes them, else its slice of the whole), capacity and aux statistics over all the axes' rows, as
    `moe_forward` on the whole call."""
    n_ep = _expert_ways(cfg, int(sizes.get(EXPERT_AXIS, 1)) if EXPERT_AXIS in token_axes else 1, EXPERT_AXIS)
    if n_ep > 1:
        e_local = cfg.num_experts // n_ep
        held = {n: int(v.shape[0]) for n, v in w.items() if n in _EXPERT_WEIGHTS}
        if set(held.values()) == {cfg.num_experts}:  # every expert held: this rank's slice
            start = jax.lax.axis_index(EXPERT_AXIS) * e_local
            w = {n: jax.lax.dynamic_slice_in_dim(v, start, e_local) if n in held else v for n, v in w.items()}
        elif set(held.values()) != {e_local}:
            raise ShardingError(
                f"expected the experts' weights to hold all num_experts={cfg.num_experts} experts or this "
                f"{EXPERT_AXIS!r} rank's {e_local} (of {n_ep} ranks), found {held}; split them over the "
                f"{EXPERT_AXIS!r} axis of this mesh, or pass them whole"
            )
    calls = math.prod(int(sizes[a]) for a in token_axes)
    return _ep_local(
        w,
        x,
        cfg=cfg,
        expert_axis=EXPERT_AXIS if n_ep > 1 else None,
        token_axes=token_axes,
        tensor_axis=None,
        n_ep=n_ep,
        tokens=math.prod(x.shape[:-1]) * calls,
    )


_INIT = nnx.initializers.normal(0.02)


def _named(*names: str | None) -> dict[str, Any]:
    """Logical dim names (`openhosti_jax.sharding.rules`: ``"experts"`` over ``expert``, ``"mlp"`` over
    ``tensor``), applied by the plan, not at init."""
    return {"out_sharding": names, "eager_sharding": False}


class MoEBlock(nnx.Module):
    """Router ``(d_model, num_experts)``; routed SwiGLU experts stacked ``w_gate``/``w_up`` ``(num_experts,
    d_model, d_ff)`` and ``w_down`` ``(num_experts, d_ff, d_model)``; with ``num_shared_experts``, one shared SwiGLU
    ``shared_gate``/``shared_up``/``shared_down`` of width ``num_shared_experts * d_ff``. No biases; weights
    ``normal(0.02)``. Returns ``(y, aux)``: the residual is the caller's."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts
        self.cfg = cfg
        self.dtype = jnp.dtype(cfg.dtype)  # a precision policy's compute dtype replaces it, as nnx.Linear's
        self.router = nnx.Param(_INIT(rngs.params(), (d, e), jnp.float32), **_named("embed", None))
        self.w_gate = nnx.Param(_INIT(rngs.params(), (e, d, f), jnp.float32), **_named("experts", "embed", "mlp"))
        self.w_up = nnx.Param(_INIT(rngs.params(), (e, d, f), jnp.float32), **_named("experts", "embed", "mlp"))
        self.w_down = nnx.Param(_INIT(rngs.params(), (e, f, d), jnp.float32), **_named("experts", "mlp", "embed"))
        if cfg.num_shared_experts:
            s = cfg.num_shared_experts * f
            self.shared_gate = nnx.Param(_INIT(rngs.params(), (d, s), jnp.float32), **_named("embed", "mlp"))
            self.shared_up = nnx.Param(_INIT(rngs.params(), (d, s), jnp.float32), **_named("embed", "mlp"))
            self.shared_down = nnx.Param(_INIT(rngs.params(), (s, d), jnp.float32), **_named("mlp", "embed"))

    def config(self) -> MoEConfig:
        """``cfg`` computing in the block's current ``dtype`` (which a precision policy sets, as for the model's
        other layers: under bf16 the experts and their exchanged tokens are bf16, not float32 copies)."""
        dt = jnp.dtype(self.dtype)
        return self.cfg if jnp.dtype(self.cfg.dtype) == dt else dataclasses.replace(self.cfg, dtype=dt.name)

    def weights(self) -> dict[str, jax.Array]:
        """The parameters' values by name, as `moe_forward` and `expert_parallel` take them."""
        names = ("router", *_EXPERT_WEIGHTS, *(_SHARED_WEIGHTS if self.cfg.num_shared_experts else ()))
        return {n: getattr(self, n)[...] for n in names}

    def __call__(
        self, x: jax.Array, mesh: Mesh | None = None, *, expert_axis: str = "expert", data_axis: str | None = "data"
    ) -> tuple[jax.Array, MoEAux]:
        """``(y, aux)`` for ``x`` ``(..., d_model)``; on ``mesh``, expert-parallel (`expert_parallel`)."""
        if x.shape[-1] != self.cfg.d_model:
            raise BatchError(f"expected x (..., d_model={self.cfg.d_model}), found shape {tuple(x.shape)}")
        if mesh is None:
            return moe_forward(self.config(), self.weights(), x)
        return expert_parallel(self.config(), self.weights(), x, mesh, expert_axis=expert_axis, data_axis=data_axis)
