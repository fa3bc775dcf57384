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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import BatchError, ConfigError, ShardingError
from openhosti_jax.models.checks import dtype_problem, finite_number, positive_ints

_POSITIVE_INTS = ("d_model", "d_ff", "num_experts", "top_k")
_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
_SHARED_WEIGHTS = ("shared_gate", "shared_up", "shared_down")


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


def _route_local(cfg: MoEConfig, router: jax.Array, x: jax.Array) -> tuple[Routing, jax.Array]:
    """(routing with positions among these tokens, kept all True; int32 counts per expert)."""
    e, k = cfg.num_experts, cfg.top_k
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
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
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def _experts_batched(h: jax.Array, w: dict[str, jax.Array], dt: jnp.dtype) -> jax.Array:
    """Each expert's SwiGLU on its own rows: ``h`` ``(E, rows, d_model)``, weights ``(E, ...)``."""
    g, u, d = (w[n].astype(dt) for n in _EXPERT_WEIGHTS)
    a = jax.nn.silu(jnp.einsum("erd,edf->erf", h, g)) * jnp.einsum("erd,edf->erf", h, u)
    return jnp.einsum("erf,efd->erd", a, d)


def _experts_grouped(h: jax.Array, sizes: jax.Array, w: dict[str, jax.Array], dt: jnp.dtype) -> jax.Array:
    """Experts' SwiGLU on rows ``h`` ``(rows, d_model)`` sorted by expert, ``sizes[e]`` rows each (rows past
    ``sum(sizes)`` come out zero)."""
    g, u, d = (w[n].astype(dt) for n in _EXPERT_WEIGHTS)
    a = jax.nn.silu(jax.lax.ragged_dot(h, g, sizes)) * jax.lax.ragged_dot(h, u, sizes)
    return jax.lax.ragged_dot(a, d, sizes)


def _combine(cfg: MoEConfig, w: dict[str, jax.Array], x: jax.Array, r: Routing, per_assignment: jax.Array) -> jax.Array:
    """Weighted sum of each token's expert outputs ``(T * top_k, d_model)``, plus the shared experts."""
    t, d = x.shape
    y = jnp.einsum("tk,tkd->td", r.weights, per_assignment.reshape(t, cfg.top_k, d).astype(jnp.float32))
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
    expert_axis: str,
    token_axes: tuple[str, ...],
    n_ep: int,
    tokens: int,
) -> tuple[jax.Array, MoEAux]:
    """One device's part of `expert_parallel`: route the local tokens, send each assignment to the device holding
    its expert (all_to_all over ``expert_axis``), run the local experts, send the outputs back, combine."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    t, d = xt.shape
    e, k, dt = cfg.num_experts, cfg.top_k, jnp.dtype(cfg.dtype)
    e_local = e // n_ep
    r, counts = _route_local(cfg, w["router"], xt)
    c = cfg.capacity(tokens)

    def exchange(v: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(v, expert_axis, 0, 0)

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
    aux = _aux(cfg, r, counts, dropped, lambda v: jax.lax.psum(v, token_axes), tokens)
    return y.reshape(shape), aux


def expert_parallel(
    cfg: MoEConfig,
    w: dict[str, jax.Array],
    x: jax.Array,
    mesh: Mesh,
    *,
    expert_axis: str = "expert",
    data_axis: str | None = "data",
) -> tuple[jax.Array, MoEAux]:
    """The block with its experts split over ``mesh``'s ``expert_axis`` under `jax.shard_map`: equal to
    `moe_forward` (the same tokens dropped in capacity mode), as ``(y, aux)``.

    ``x`` ``(batch, ..., d_model)`` is split on ``batch`` over ``data_axis`` x ``expert_axis`` (``data_axis=None``:
    ``expert_axis`` alone); the routed experts' weights over ``expert_axis`` (replicated over ``data_axis``), the
    router and shared experts replicated. Tokens go to their experts' devices and back by two
    `jax.lax.all_to_all` over ``expert_axis``. Dropless exchanges are padded to the worst case (every local
    assignment bound for one device): each device receives ``expert`` x its local assignments' rows. In capacity
    mode the capacity is the whole call's, as on one device: an all-gather of the per-expert counts gives each
    assignment its slot among all tokens (shards in token order), so the same assignments are dropped, and each
    device sends ``min(capacity, local tokens)`` slots per expert. The aux losses and metrics are summed over the
    token shards. On a mesh of `jax.sharding.AxisType.Explicit` axes the inputs are resharded to these specs and
    ``y`` back to ``x``'s.
    """
    names = mesh.axis_names
    if expert_axis not in names:
        raise ShardingError(f"expected an expert axis {expert_axis!r} in the mesh, found axes {names}")
    if data_axis is not None and data_axis not in names:
        raise ShardingError(
            f"expected a data axis {data_axis!r} in the mesh, found axes {names}; pass data_axis=None to split the "
            "tokens over the expert axis alone"
        )
    n_ep = mesh.shape[expert_axis]
    if cfg.num_experts % n_ep:
        raise ShardingError(
            f"the {expert_axis!r} axis has size {n_ep}, which does not divide num_experts={cfg.num_experts}; use a "
            f"mesh whose {expert_axis!r} size divides it"
        )
    token_axes = (expert_axis,) if data_axis is None else (data_axis, expert_axis)
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if x.ndim < 2 or x.shape[-1] != cfg.d_model or x.shape[0] % shards:
        raise BatchError(
            f"expected x (batch, ..., d_model={cfg.d_model}) with batch divisible by {shards} "
            f"({' x '.join(token_axes)}), found shape {tuple(x.shape)}"
        )
    specs = {n: P(expert_axis) if n in _EXPERT_WEIGHTS else P() for n in w}
    x_spec = P(token_axes)
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    if explicit:  # shard_map then wants its inputs placed as specified; y goes back to x's placement
        x_placed = jax.typeof(x).sharding.spec
        w = {n: jax.reshard(v, NamedSharding(mesh, specs[n])) for n, v in w.items()}
        x = jax.reshard(x, NamedSharding(mesh, x_spec))
    local = functools.partial(
        _ep_local,
        cfg=cfg,
        expert_axis=expert_axis,
        token_axes=token_axes,
        n_ep=n_ep,
        tokens=math.prod(x.shape[:-1]),
    )
    aux_spec = MoEAux(*(P(),) * len(MoEAux._fields))
    y, aux = jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec), out_specs=(x_spec, aux_spec))(w, x)
    return (jax.reshard(y, NamedSharding(mesh, x_placed)) if explicit else y), aux


_INIT = nnx.initializers.normal(0.02)


class MoEBlock(nnx.Module):
    """Router ``(d_model, num_experts)``; routed SwiGLU experts stacked ``w_gate``/``w_up`` ``(num_experts,
    d_model, d_ff)`` and ``w_down`` ``(num_experts, d_ff, d_model)``; with ``num_shared_experts``, one shared SwiGLU
    ``shared_gate``/``shared_up``/``shared_down`` of width ``num_shared_experts * d_ff``. No biases; weights
    ``normal(0.02)``. Returns ``(y, aux)``: the residual is the caller's."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts
        self.cfg = cfg
        self.router = nnx.Param(_INIT(rngs.params(), (d, e), jnp.float32))
        self.w_gate = nnx.Param(_INIT(rngs.params(), (e, d, f), jnp.float32))
        self.w_up = nnx.Param(_INIT(rngs.params(), (e, d, f), jnp.float32))
        self.w_down = nnx.Param(_INIT(rngs.params(), (e, f, d), jnp.float32))
        if cfg.num_shared_experts:
            s = cfg.num_shared_experts * f
            self.shared_gate = nnx.Param(_INIT(rngs.params(), (d, s), jnp.float32))
            self.shared_up = nnx.Param(_INIT(rngs.params(), (d, s), jnp.float32))
            self.shared_down = nnx.Param(_INIT(rngs.params(), (s, d), jnp.float32))

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
            return moe_forward(self.cfg, self.weights(), x)
        return expert_parallel(self.cfg, self.weights(), x, mesh, expert_axis=expert_axis, data_axis=data_axis)
