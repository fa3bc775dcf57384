"""OptimizedDDP's drop-in mode against plain torch on one process: the user's loop unchanged (``model(x)``,
``loss.backward()``, a torch optimizer's ``step()``), the forward and backward run as JAX programs over 8 devices."""

import copy
import importlib.util

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:  # imported through the shim only: plain import fails on torch 2.13
    pytest.skip("needs torchax (the torch extra)", allow_module_level=True)

from openhosti_jax.bridges.torch_lowering import import_torchax  # noqa: E402
from openhosti_jax.frontends.torch_ddp import OptimizedDDP  # noqa: E402
from openhosti_jax.mesh import MeshConfig, build_mesh  # noqa: E402

pytestmark = pytest.mark.torch  # needs the torch extra


class TinyGPT(torch.nn.Module):
    """An embedding tied to the head around one transformer encoder layer (dropout off)."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.block = torch.nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def _train(model, make_opt, batches, steps=5):
    opt = make_opt(model.parameters())
    losses = []
    for tokens, targets in batches[:steps]:
        opt.zero_grad()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_drop_in_trains_as_plain_torch(optimizer):
    torch.manual_seed(0)
    reference = TinyGPT()
    ours = copy.deepcopy(reference)
    ours.head.weight = ours.embed.weight  # deepcopy keeps the tie; say it plainly
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 64, (8, 12), generator=g), torch.randint(0, 64, (8, 12), generator=g)) for _ in range(5)
    ]
    make = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    }[optimizer]
    expected = _train(reference, make, batches)
    got = _train(OptimizedDDP(ours), make, batches)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert expected[-1] < expected[0]
    assert ours.head.weight is ours.embed.weight  # the tie survives training
    for (name, a), b in zip(reference.named_parameters(), ours.parameters(), strict=True):
        if optimizer == "adamw" and name.endswith("in_proj_bias"):
            continue  # the key bias has an exactly-zero gradient whose float noise Adam amplifies
        np.testing.assert_allclose(b.detach().numpy(), a.detach().numpy(), atol=1e-5, err_msg=name)


@pytest.mark.timeout(300)
def test_eval_mode_and_a_batch_that_does_not_divide_the_devices():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    ddp = OptimizedDDP(copy.deepcopy(model)).eval()
    tokens = torch.randint(0, 64, (8, 12))
    with torch.no_grad():
        np.testing.assert_allclose(ddp(tokens).numpy(), model(tokens).numpy(), atol=1e-5)
    short = torch.randint(0, 64, (6, 12))  # 6 rows on 8 devices: split unevenly
    with torch.no_grad():
        np.testing.assert_allclose(ddp(short).numpy(), model(short).numpy(), atol=1e-5)


def test_importing_torchax_leaves_torch_as_it_was():
    before = torch.backends.mha.get_fastpath_enabled()
    import_torchax()
    assert torch.backends.mha.get_fastpath_enabled() == before
    with pytest.raises(AttributeError):
        torch.ops.aten.prod.no_such_overload  # noqa: B018  (only removed named-tensor overloads were lenient)


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


@pytest.mark.timeout(600)
def test_batch_norm_statistics_and_parameters_follow_torch():
    torch.manual_seed(0)
    reference = ConvNet()
    ours = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 3, 6, 6, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(5)]
    make = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    ddp = OptimizedDDP(ours)
    for model in (reference, ddp):
        opt = make(model.parameters())
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for (name, a), b in zip(reference.state_dict().items(), ours.state_dict().values(), strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-5, err_msg=name)
    assert int(ours.bn.num_batches_tracked) == 5
    ddp.eval()
    reference.eval()
    with torch.no_grad():  # eval uses the running statistics
        np.testing.assert_allclose(ddp(batches[0][0]).numpy(), reference(batches[0][0]).numpy(), atol=1e-5)


@pytest.mark.timeout(300)
def test_dropout_draws_new_masks_and_its_gradient_uses_the_same_mask():
    """Linear then dropout(0.5): the mask is read off the output (kept values are doubled, dropped are zero), and
    torch computes the gradient of the same masked model; each training call draws a new mask (JAX's stream)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 16)
    reference = copy.deepcopy(lin)
    ddp = OptimizedDDP(torch.nn.Sequential(lin, torch.nn.Dropout(0.5)))
    x = torch.randn(8, 6) + 3.0  # positive pre-activations: a zero output is a dropped unit
    out = ddp(x)
    out.pow(2).sum().backward()
    mask = (out.detach() != 0).float()
    assert 0.2 < float(mask.mean()) < 0.8
    (reference(x) * mask * 2.0).pow(2).sum().backward()
    np.testing.assert_allclose(lin.weight.grad.numpy(), reference.weight.grad.numpy(), rtol=1e-5, atol=1e-5)
    assert not torch.equal((ddp(x).detach() != 0), mask.bool())  # a new mask on the next call
    ddp.eval()
    with torch.no_grad():
        np.testing.assert_allclose(ddp(x).numpy(), lin(x).numpy(), atol=1e-5)  # no dropout in eval


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["fsdp", "auto", "fsdp-axis"])
def test_full_mode_trains_as_plain_torch_with_sharded_state(plan):
    """torch AdamW with two parameter groups (decay on matrices only, another rate for the rest) mapped to optax; the
    module's weights come back through state_dict(). ``fsdp-axis``: a mesh whose 8 devices are on its ``fsdp`` axis,
    the batch split over it (``data_axis="fsdp"``), the parameters sharded over it."""
    torch.manual_seed(0)
    reference = TinyGPT(vocab=256)  # an embedding large enough to shard (>= 4096 elements)
    ours = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 256, (8, 12), generator=g), torch.randint(0, 256, (8, 12), generator=g)) for _ in range(5)
    ]
    opt = torch.optim.AdamW(_groups(reference), lr=1e-2)
    expected = []
    for x, y in batches:
        opt.zero_grad()
        loss = _loss(reference(x), y)
        loss.backward()
        opt.step()
        expected.append(float(loss.detach()))
    kw = {"mesh": build_mesh(MeshConfig(data=1, fsdp=8)), "data_axis": "fsdp"} if plan == "fsdp-axis" else {}
    opt = torch.optim.AdamW(_groups(ours), lr=1e-2)
    ddp = OptimizedDDP(ours, optimizer=opt, criterion=_loss, plan="fsdp" if plan == "fsdp-axis" else plan, **kw)
    got = [float(ddp.train_step(x, y)) for x, y in batches]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    if plan != "auto":  # ZeRO-3: the embedding is split over the 8 devices of the batch's axis
        emb = ddp.full_state.params["embed.weight"]
        local = emb.addressable_shards[0].data.shape
        assert local[0] * local[1] * 8 == emb.shape[0] * emb.shape[1]
        assert ddp.data_axis in jax.tree.leaves(tuple(emb.sharding.spec))
    state = ddp.state_dict()
    for (name, a), b in zip(reference.state_dict().items(), ours.state_dict().values(), strict=True):
        if name.endswith("in_proj_bias"):
            continue  # the key bias's exactly-zero gradient: Adam amplifies its float noise
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-5, err_msg=name)
    assert set(state) == {f"module.{k}" for k in ours.state_dict()}


def test_bad_input_is_named():
    from openhosti_jax.errors import BridgeError

    torch.manual_seed(0)
    model = TinyGPT()
    with pytest.raises(BridgeError, match="LBFGS has no equivalent here"):
        OptimizedDDP(model, optimizer=torch.optim.LBFGS(model.parameters()), criterion=_loss)
    with pytest.raises(BridgeError, match="both optimizer"):
        OptimizedDDP(model, criterion=_loss)
    with pytest.raises(BridgeError, match="full mode"):
        OptimizedDDP(model).train_step(torch.zeros(8, 12, dtype=torch.long), torch.zeros(8, 12, dtype=torch.long))

    class Poisson(torch.nn.Module):
        def forward(self, x):
            return torch.poisson(x)

    class Fresh(torch.nn.Module):
        def forward(self, x):
            return x + torch.ones(x.shape[-1])

    net = torch.nn.Sequential()
    net.add_module("lin", torch.nn.Linear(4, 4))
    net.add_module("poisson", Poisson())
    with pytest.raises(BridgeError, match=r"aten::poisson has no lowering in module 'poisson'"):
        OptimizedDDP(net)(torch.ones(8, 4))
    with pytest.raises(BridgeError, match=r"in module 'Fresh' lives on torch's CPU device"):
        OptimizedDDP(Fresh())(torch.ones(8, 4))
