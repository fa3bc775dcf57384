"""Every torch optimizer the full mode takes, stepped through `openhosti_jax.bridges.torch_optim` on a linear
regression, against torch's own steps; schedulers' rates and momenta reach the state; the rest is refused by name."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("needs torchax (the torch extra)", allow_module_level=True)

from openhosti_jax.bridges.torch_optim import TorchOptimizer, set_hyperparams  # noqa: E402
from openhosti_jax.errors import BridgeError  # noqa: E402

pytestmark = pytest.mark.torch

optim = torch.optim
CASES = {
    "sgd": lambda p: optim.SGD(p, lr=0.1),
    "sgd-momentum-dampening-wd": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "sgd-nesterov-maximize": lambda p: optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, maximize=True),
    "adam": lambda p: optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    "adam-amsgrad": lambda p: optim.Adam(p, lr=1e-2, amsgrad=True),
    "adam-decoupled": lambda p: optim.Adam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "adamw": lambda p: optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad-maximize": lambda p: optim.AdamW(p, lr=1e-2, amsgrad=True, maximize=True),
    "adamax": lambda p: optim.Adamax(p, lr=1e-2, weight_decay=0.05),
    "nadam": lambda p: optim.NAdam(p, lr=1e-2, weight_decay=0.05),
    "nadam-decoupled": lambda p: optim.NAdam(p, lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True),
    "radam": lambda p: optim.RAdam(p, lr=1e-2, betas=(0.9, 0.9)),  # beta2 0.9: the rectified branch from step 6
    "radam-decoupled": lambda p: optim.RAdam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "adadelta": lambda p: optim.Adadelta(p, lr=1.0, rho=0.8, weight_decay=0.01),
    "adagrad": lambda p: optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01),
    "rmsprop": lambda p: optim.RMSprop(p, lr=1e-2),
    "rmsprop-centered-momentum": lambda p: optim.RMSprop(p, lr=1e-2, centered=True, momentum=0.9, weight_decay=0.01),
    "adam-foreach": lambda p: optim.Adam(p, lr=1e-2, foreach=True),  # a kernel choice: the same update
}


def _problem():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)
    w, b = torch.randn(3, 5, generator=g), torch.randn(3, generator=g)
    return x, y, w, b


def _torch_loss(w, b, x, y):
    return ((x @ w.T + b - y) ** 2).mean()


def _two_groups(w, b):
    return [{"params": [w]}, {"params": [b], "lr_scale": 1.0}]  # an extra key torch ignores, and so do we


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_steps_as_torch(case):
    x, y, w0, b0 = _problem()
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = CASES[case](_two_groups(w, b))
    ours = TorchOptimizer(opt, {"w": w, "b": b})
    params = {"w": jnp.asarray(w0.numpy()), "b": jnp.asarray(b0.numpy())}
    state = ours.tx.init(params)
    xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    grad = jax.jit(jax.grad(lambda p: jnp.mean((xj @ p["w"].T + p["b"] - yj) ** 2)))
    for _ in range(8):
        state = set_hyperparams(state, ours.hyperparams())
        updates, state = ours.tx.update(grad(params), state, params)
        params = optax.apply_updates(params, updates)
        opt.zero_grad()
        _torch_loss(w, b, x, y).backward()
        opt.step()
    np.testing.assert_allclose(np.asarray(params["w"]), w.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(params["b"]), b.detach().numpy(), atol=1e-5, rtol=1e-5)
    assert not np.allclose(w.detach().numpy(), w0.numpy(), atol=1e-3)  # it moved


@pytest.mark.parametrize("sched", ["onecycle-adam", "onecycle-sgd", "step", "plateau"])
def test_schedulers_reach_the_state_without_retracing(sched):
    """The rate (and OneCycleLR's cycled momentum / beta1) of every step is read from param_groups."""
    x, y, w0, b0 = _problem()
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    if sched == "onecycle-sgd":
        opt = optim.SGD([w, b], lr=0.1, momentum=0.9, nesterov=True)
    else:
        opt = optim.Adam([w, b], lr=1e-2)
    s = {
        "onecycle-adam": lambda: optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8),
        "onecycle-sgd": lambda: optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=8),
        "step": lambda: optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),
        "plateau": lambda: optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=0, factor=0.5),
    }[sched]()
    ours = TorchOptimizer(opt, {"w": w, "b": b})
    params = {"w": jnp.asarray(w0.numpy()), "b": jnp.asarray(b0.numpy())}
    state = ours.tx.init(params)
    xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    traces = []

    @jax.jit
    def step(params, state):
        traces.append(1)
        g = jax.grad(lambda p: jnp.mean((xj @ p["w"].T + p["b"] - yj) ** 2))(params)
        updates, state = ours.tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    rates = []  # ReduceLROnPlateau in mode "max" sees the falling loss as no gain: it halves the rate each step
    for _ in range(8):
        state = set_hyperparams(state, ours.hyperparams())
        params, state = step(params, state)
        opt.zero_grad()
        loss = _torch_loss(w, b, x, y)
        loss.backward()
        opt.step()
        s.step(loss.item()) if sched == "plateau" else s.step()
        rates.append(opt.param_groups[0]["lr"])
    assert len(traces) == 1 and len(set(rates)) > 2
    np.testing.assert_allclose(np.asarray(params["w"]), w.detach().numpy(), atol=1e-5, rtol=1e-5)


def test_refusals_name_the_optimizer_and_option():
    w = torch.nn.Parameter(torch.ones(2, 2))
    for kind in (optim.LBFGS, optim.Rprop, optim.ASGD, optim.SparseAdam):
        with pytest.raises(BridgeError, match=f"torch.optim.{kind.__name__} has no equivalent.*drop-in mode"):
            TorchOptimizer(kind([w]), {"w": w})
    opt = optim.SGD([w], lr=0.1, momentum=0.9)
    ours = TorchOptimizer(opt, {"w": w})
    opt.param_groups[0]["nesterov"] = True
    with pytest.raises(BridgeError, match=r"changed \{'nesterov': True\}"):
        ours.hyperparams()
    newer = optim.Adam([w], lr=0.1)  # an option a later torch adds, set away from its default: refused by name
    newer.defaults["lookahead"] = 0
    newer.param_groups[0]["lookahead"] = 5
    with pytest.raises(BridgeError, match=r"Adam option\(s\) \['lookahead'\] have no equivalent"):
        TorchOptimizer(newer, {"w": w})
    with pytest.raises(BridgeError, match="in no optimizer group"):
        TorchOptimizer(optim.SGD([w], lr=0.1), {"w": w, "v": torch.nn.Parameter(torch.ones(1))})
