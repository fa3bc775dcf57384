"""A torch optimizer as its optax equivalent: AdamW, Adam and SGD (momentum, Nesterov), with their hyperparameters,
weight decay as each applies it, and parameter groups.

torch's ``Adam(weight_decay=)`` adds ``wd * p`` to the gradient before the moments (L2); ``AdamW`` subtracts
``lr * wd * p`` beside the Adam step (decoupled, as `optax.adamw`); ``SGD(weight_decay=)`` adds it to the gradient.
Learning-rate schedulers are not carried over: the rate is each group's ``lr`` when the optimizer is converted.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> tx = optax_from_torch(torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9), dict(lin.named_parameters()))
    >>> sorted(tx.init({"weight": lin.weight.detach().numpy(), "bias": lin.bias.detach().numpy()}).inner_states)
    ['group0']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from openhosti_jax.errors import BridgeError

SUPPORTED = ("AdamW", "Adam", "SGD")
"""torch optimizers with an optax equivalent here."""


def _group(kind: str, g: Mapping[str, Any]) -> optax.GradientTransformation:
    unsupported = {
        k: g[k]
        for k, default in (("amsgrad", False), ("dampening", 0), ("maximize", False), ("capturable", False))
        if k in g and g[k] != default
    }
    if unsupported:
        raise BridgeError(f"torch.optim.{kind} with {unsupported} has no optax equivalent here; use the defaults")
    lr, wd = float(g["lr"]), float(g.get("weight_decay", 0.0))
    if kind == "AdamW":
        b1, b2 = g["betas"]
        return optax.adamw(lr, b1=b1, b2=b2, eps=g["eps"], weight_decay=wd)
    if kind == "Adam":
        b1, b2 = g["betas"]
        return optax.chain(optax.add_decayed_weights(wd), optax.adam(lr, b1=b1, b2=b2, eps=g["eps"]))
    momentum = float(g.get("momentum", 0.0))
    sgd = optax.sgd(lr, momentum=momentum or None, nesterov=bool(g.get("nesterov", False)))
    return optax.chain(optax.add_decayed_weights(wd), sgd)


def optax_from_torch(optimizer: Any, named_params: Mapping[str, Any]) -> optax.GradientTransformation:
    """The optax transformation of ``optimizer`` over a parameter dict keyed as ``named_params`` (name -> the torch
    parameter): one transformation per parameter group (`optax.multi_transform`, labelled ``group<i>``)."""
    kind = type(optimizer).__name__
    if kind not in SUPPORTED:
        raise BridgeError(
            f"torch.optim.{kind} has no optax equivalent here; the full mode takes {SUPPORTED}. Use the drop-in mode "
            "(OptimizedDDP without optimizer=), which keeps your torch optimizer"
        )
    owner = {id(p): name for name, p in named_params.items()}
    labels: dict[str, str] = {}
    transforms = {}
    for i, g in enumerate(optimizer.param_groups):
        transforms[f"group{i}"] = _group(kind, g)
        for p in g["params"]:
            if id(p) not in owner:
                raise BridgeError(f"the optimizer's group {i} holds a parameter the module does not have")
            labels[owner[id(p)]] = f"group{i}"
    missing = sorted(set(named_params) - set(labels))
    if missing:
        raise BridgeError(f"parameters {missing} are in no optimizer group; give them to the optimizer")
    return optax.multi_transform(transforms, {k: labels[k] for k in named_params})
