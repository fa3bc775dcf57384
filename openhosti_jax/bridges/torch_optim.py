"""A torch optimizer as an optax transformation that steps as torch's does, with its parameter groups, and whose
hyperparameters follow the optimizer's ``param_groups`` every step (so every torch LR scheduler is honoured).

SGD (momentum, dampening, Nesterov, weight decay), Adam and AdamW (amsgrad, decoupled weight decay), Adamax,
NAdam, RAdam, Adadelta, Adagrad (lr decay, initial accumulator) and RMSprop (centered, momentum), each with
``maximize``, follow torch's single-tensor update formulas (`torch.optim`'s ``_single_tensor_*``). Each group's float
hyperparameters (``lr``, ``momentum``, ``betas``, ``weight_decay``, ...) live in the optimizer state as arrays:
`TorchOptimizer.hyperparams` reads them from ``param_groups`` and `set_hyperparams` puts them into a state, so a
scheduler's new rate reaches the next step without a retrace. Options that change the update's form (``nesterov``,
``amsgrad``, ``centered``, ``maximize``, ``momentum`` zero or not) are fixed when the optimizer is converted; changing
one later is a `BridgeError`. ``foreach``, ``fused``, ``capturable`` and ``differentiable`` pick torch's kernel, not
the update, so they do not matter here. Any other optimizer (LBFGS, Rprop, ASGD, SparseAdam, ...) is refused by name.

One difference stays: a parameter the loss does not reach gets a zero gradient here, where torch skips it (its
moments do not decay).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> opt = TorchOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9), dict(lin.named_parameters()))
    >>> opt.hyperparams()["group0"]["lr"]
    0.1
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from openhosti_jax.errors import BridgeError

_KERNEL_ONLY = ("foreach", "fused", "capturable", "differentiable")


class _Kind(NamedTuple):
    floats: tuple[str, ...]  # hyperparameters read every step
    flags: tuple[str, ...]  # options that fix the update's form
    slots: tuple[str, ...]  # per-parameter state


_KINDS = {
    "SGD": _Kind(("lr", "momentum", "dampening", "weight_decay"), ("nesterov", "maximize", "has_momentum"), ("buf",)),
    "Adam": _Kind(("lr", "b1", "b2", "eps", "weight_decay"), ("amsgrad", "maximize", "decoupled"), ("m", "v", "vmax")),
    "Adamax": _Kind(("lr", "b1", "b2", "eps", "weight_decay"), ("maximize",), ("m", "u")),
    "NAdam": _Kind(("lr", "b1", "b2", "eps", "weight_decay", "momentum_decay"), ("maximize", "decoupled"), ("m", "v")),
    "RAdam": _Kind(("lr", "b1", "b2", "eps", "weight_decay"), ("maximize", "decoupled"), ("m", "v")),
    "Adadelta": _Kind(("lr", "rho", "eps", "weight_decay"), ("maximize",), ("sq", "acc")),
    "Adagrad": _Kind(("lr", "lr_decay", "eps", "weight_decay"), ("maximize",), ("sum",)),
    "RMSprop": _Kind(
        ("lr", "alpha", "eps", "weight_decay", "momentum"),
        ("centered", "maximize", "has_momentum"),
        ("sq", "ga", "buf"),
    ),
}
_KINDS["AdamW"] = _KINDS["Adam"]
SUPPORTED = tuple(_KINDS)
"""torch optimizers this module steps as torch does."""


class _State(NamedTuple):
    hyper: dict[str, jax.Array]
    """The group's float hyperparameters (and ``log_b1``/``log_b2`` for exact bias corrections), refreshed per step."""
    count: jax.Array
    mu_product: jax.Array  # NAdam's product of momentum coefficients (1 elsewhere)
    slots: dict[str, Any]


def _floats(kind: str, g: Mapping[str, Any]) -> dict[str, float]:
    """The group's hyperparameters by this module's names (betas split; ``1-x`` and ``log_x`` computed here in float64,
    since float32's ``1 - 0.999`` is off by 1e-5 relative)."""
    out: dict[str, float] = {}
    for name in _KINDS[kind].floats:
        out[name] = float(g["betas"][name == "b2"]) if name in ("b1", "b2") else float(g[name])
        if name in ("b1", "b2", "rho", "alpha"):  # 1 - x and log x in float64, as torch's Python floats
            out[f"1-{name}"] = 1.0 - out[name]
        if name in ("b1", "b2"):
            out[f"log_{name}"] = math.log(out[name]) if out[name] > 0 else -math.inf
    return out


def _flags(kind: str, g: Mapping[str, Any]) -> dict[str, bool]:
    flags = {"maximize": bool(g.get("maximize", False)), "nesterov": bool(g.get("nesterov", False))}
    flags["amsgrad"], flags["centered"] = bool(g.get("amsgrad", False)), bool(g.get("centered", False))
    flags["decoupled"] = kind == "AdamW" or bool(g.get("decoupled_weight_decay", False))
    flags["has_momentum"] = float(g.get("momentum", 0.0)) != 0.0
    return {k: flags[k] for k in _KINDS[kind].flags}


def _slots(kind: str, flags: Mapping[str, bool]) -> tuple[str, ...]:
    """The per-parameter state torch keeps for these options (no AMSGrad maximum without ``amsgrad``, ...)."""
    unused = {"vmax": not flags.get("amsgrad"), "ga": not flags.get("centered"), "buf": not flags.get("has_momentum")}
    return tuple(s for s in _KINDS[kind].slots if not unused.get(s, False))


def _bias(t: jax.Array, log_b: jax.Array) -> jax.Array:
    """``1 - b**t`` without float32's cancellation near b = 1."""
    return -jnp.expm1(t * log_b)


def _rule(kind: str, flags: Mapping[str, bool]) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """``rule(g, p, slots, h, t, mu_product, mu, mu_next) -> (update, slots)`` for one parameter, as torch steps it."""

    def rule(g: Any, p: Any, s: dict[str, Any], h: dict[str, Any], t: Any, mp: Any, mu: Any, mu_next: Any) -> Any:
        g = -g if flags.get("maximize") else g
        lr, wd = h["lr"], h["weight_decay"]
        decay = jnp.zeros_like(p)
        if flags.get("decoupled"):
            decay = -lr * wd * p
        else:
            g = g + wd * p
        if kind == "SGD":
            if flags["has_momentum"]:
                buf = jnp.where(t == 1, g, h["momentum"] * s["buf"] + (1 - h["dampening"]) * g)
                s = {"buf": buf}
                g = g + h["momentum"] * buf if flags["nesterov"] else buf
            return -lr * g, s
        if kind in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam"):
            m = s["m"] + h["1-b1"] * (g - s["m"])
            bc1 = _bias(t, h["log_b1"])
            if kind == "Adamax":
                u = jnp.maximum(s["u"] * h["b2"], jnp.abs(g) + h["eps"])
                return -(lr / bc1) * m / u, {"m": m, "u": u}
            v = s["v"] * h["b2"] + h["1-b2"] * g * g
            bc2 = _bias(t, h["log_b2"])
            if kind == "NAdam":
                denom = jnp.sqrt(v / bc2) + h["eps"]
                step = -lr * (1 - mu) / (1 - mp) * g / denom - lr * mu_next / (1 - mp * mu_next) * m / denom
                return decay + step, {"m": m, "v": v}
            if kind == "RAdam":
                rho_inf = 2 / h["1-b2"] - 1
                rho_t = rho_inf - 2 * t * jnp.exp(t * h["log_b2"]) / bc2
                rect = jnp.sqrt(
                    jnp.maximum((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t), 0)
                )
                adaptive = jnp.sqrt(bc2) / (jnp.sqrt(v) + h["eps"])
                scale = jnp.where(rho_t > 5.0, rect * adaptive, 1.0)
                return decay - m / bc1 * lr * scale, {"m": m, "v": v}
            slots = {"m": m, "v": v}
            if flags["amsgrad"]:
                slots["vmax"] = jnp.maximum(s["vmax"], v)
            denom = jnp.sqrt(slots["vmax"] if flags["amsgrad"] else v) / jnp.sqrt(bc2) + h["eps"]
            return decay - (lr / bc1) * m / denom, slots
        if kind == "Adadelta":
            sq = s["sq"] * h["rho"] + h["1-rho"] * g * g
            delta = jnp.sqrt(s["acc"] + h["eps"]) / jnp.sqrt(sq + h["eps"]) * g
            acc = s["acc"] * h["rho"] + h["1-rho"] * delta * delta
            return -lr * delta, {"sq": sq, "acc": acc}
        if kind == "Adagrad":
            total = s["sum"] + g * g
            return -(lr / (1 + (t - 1) * h["lr_decay"])) * g / (jnp.sqrt(total) + h["eps"]), {"sum": total}
        new = {"sq": s["sq"] * h["alpha"] + h["1-alpha"] * g * g}  # RMSprop
        if flags["centered"]:
            new["ga"] = s["ga"] + h["1-alpha"] * (g - s["ga"])
        avg = jnp.sqrt(new["sq"] - new["ga"] ** 2 if flags["centered"] else new["sq"]) + h["eps"]
        if flags["has_momentum"]:
            new["buf"] = h["momentum"] * s["buf"] + g / avg
            return -lr * new["buf"], new
        return -lr * g / avg, new

    return rule


def _transform(kind: str, g: Mapping[str, Any]) -> optax.GradientTransformation:
    """One parameter group's update (torch's ``kind`` with the group's options) as an optax transformation."""
    flags = _flags(kind, g)
    rule = _rule(kind, flags)
    slots = _slots(kind, flags)
    init_sum = float(g.get("initial_accumulator_value", 0.0))

    def init(params: Any) -> _State:
        hyper = {k: jnp.asarray(v, jnp.float32) for k, v in _floats(kind, g).items()}
        fill = {name: (init_sum if name == "sum" else 0.0) for name in slots}
        return _State(
            hyper,
            jnp.zeros([], jnp.int32),
            jnp.ones([], jnp.float32),
            {name: jax.tree.map(lambda p, v=v: jnp.full_like(p, v), params) for name, v in fill.items()},
        )

    def update(grads: Any, state: _State, params: Any = None) -> tuple[Any, _State]:
        if params is None:
            raise BridgeError(f"torch.optim.{kind} as optax needs the parameters: call update(grads, state, params)")
        h, count = state.hyper, state.count + 1
        t = count.astype(jnp.float32)
        mu = mu_next = mp = jnp.ones([], jnp.float32)
        if kind == "NAdam":
            mu = h["b1"] * (1.0 - 0.5 * 0.96 ** (t * h["momentum_decay"]))
            mu_next = h["b1"] * (1.0 - 0.5 * 0.96 ** ((t + 1) * h["momentum_decay"]))
            mp = state.mu_product * mu
        g_leaves, tree = jax.tree.flatten(grads)
        p_leaves = tree.flatten_up_to(params)
        s_leaves = {k: tree.flatten_up_to(v) for k, v in state.slots.items()}
        outs = [
            rule(gl, pl, {k: s_leaves[k][i] for k in s_leaves}, h, t, mp, mu, mu_next)
            for i, (gl, pl) in enumerate(zip(g_leaves, p_leaves, strict=True))
        ]
        new_slots = {k: tree.unflatten([s[k] for _, s in outs]) for k in s_leaves}
        return tree.unflatten([u for u, _ in outs]), _State(h, count, mp, new_slots)

    return optax.GradientTransformation(init, update)


class TorchOptimizer:
    """``optimizer`` (a torch optimizer) as ``tx``, an optax transformation over a parameter dict keyed as
    ``named_params`` (name -> the torch parameter): one transformation per group (labelled ``group<i>``)."""

    def __init__(self, optimizer: Any, named_params: Mapping[str, Any]) -> None:
        kind = type(optimizer).__name__
        if kind not in _KINDS:
            raise BridgeError(
                f"torch.optim.{kind} has no equivalent here; the full mode takes {SUPPORTED}. Use the drop-in mode "
                "(OptimizedDDP without optimizer=), which keeps your torch optimizer"
            )
        self.optimizer, self.kind = optimizer, kind
        owner = {id(p): name for name, p in named_params.items()}
        labels: dict[str, str] = {}
        transforms = {}
        known = set(_KINDS[kind].floats) - {"b1", "b2"} | {"betas", "params", "nesterov", "amsgrad", "centered"}
        known |= {"maximize", "decoupled_weight_decay", "initial_accumulator_value", *_KERNEL_ONLY}
        for i, g in enumerate(optimizer.param_groups):
            unknown = sorted(k for k in optimizer.defaults if k not in known and g.get(k) != optimizer.defaults[k])
            if unknown:  # an option torch reads that this module does not know
                raise BridgeError(f"torch.optim.{kind} option(s) {unknown} have no equivalent here; leave them default")
            transforms[f"group{i}"] = _transform(kind, g)
            for p in g["params"]:
                if id(p) not in owner:
                    raise BridgeError(f"the optimizer's group {i} holds a parameter the module does not have")
                labels[owner[id(p)]] = f"group{i}"
        missing = sorted(set(named_params) - set(labels))
        if missing:
            raise BridgeError(f"parameters {missing} are in no optimizer group; give them to the optimizer")
        self._flags = [_flags(kind, g) for g in optimizer.param_groups]
        self.tx = optax.multi_transform(transforms, {k: labels[k] for k in named_params})
        """The optax transformation."""

    def hyperparams(self) -> dict[str, dict[str, float]]:
        """Each group's hyperparameters as ``param_groups`` hold them now (after any scheduler's step)."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self._flags):
            raise BridgeError(
                f"the optimizer had {len(self._flags)} parameter groups when converted and has {len(groups)} now; "
                "add groups before OptimizedDDP(...)"
            )
        for i, (g, flags) in enumerate(zip(groups, self._flags, strict=True)):
            now = _flags(self.kind, g)
            if now != flags:
                changed = {k: now[k] for k in flags if now[k] != flags[k]}
                raise BridgeError(
                    f"group {i} of torch.optim.{self.kind} changed {changed} after conversion (was "
                    f"{ {k: flags[k] for k in changed} }); these fix the update's form: set them before OptimizedDDP"
                )
        return {f"group{i}": _floats(self.kind, g) for i, g in enumerate(groups)}


def set_hyperparams(opt_state: Any, values: Mapping[str, Mapping[str, float]]) -> Any:
    """``opt_state`` (a `TorchOptimizer`'s ``tx`` state) with each group's hyperparameters set to ``values``, each
    array placed as the one it replaces (no retrace: shapes, dtypes and shardings stay)."""
    inner = dict(opt_state.inner_states)
    for label, hyper in values.items():
        masked = inner[label]
        state: _State = masked.inner_state
        new = {k: jax.device_put(np.float32(hyper[k]), v.sharding) for k, v in state.hyper.items()}
        inner[label] = masked._replace(inner_state=state._replace(hyper=new))
    return opt_state._replace(inner_states=inner)


def optax_from_torch(optimizer: Any, named_params: Mapping[str, Any]) -> optax.GradientTransformation:
    """The optax transformation of ``optimizer`` with its hyperparameters as they are now (`TorchOptimizer` to
    follow a scheduler)."""
    return TorchOptimizer(optimizer, named_params).tx
