"""OptimizedDDP's drop-in mode on any call a PyTorch loop makes, against plain torch on one process (8 devices): a
DataLoader's short last batch, keyword and non-tensor arguments, structured outputs, transformers models, gradients
of inputs, the forward run once per step, and the typed errors of what cannot be lowered."""

import copy
import dataclasses
import importlib.util
from collections import namedtuple

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("needs torchax (the torch extra)", allow_module_level=True)

from openhosti_jax.bridges.torch_lowering import import_torchax  # noqa: E402
from openhosti_jax.errors import BridgeError  # noqa: E402
from openhosti_jax.frontends.torch_ddp import OptimizedDDP  # noqa: E402

pytestmark = pytest.mark.torch


def _assert_state_close(ours, reference, atol=1e-5):
    for (name, a), b in zip(reference.state_dict().items(), ours.state_dict().values(), strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=atol, err_msg=name)


@pytest.mark.timeout(600)
def test_dataloader_short_last_batch_matches_torch():
    """37 examples in batches of 8: the last batch has 5 rows, fewer than the 8 devices. A mean loss over rows and
    BatchNorm's statistics count the real rows only: parameters and running statistics equal torch's."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    ours = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(37, 6, generator=g), torch.randint(0, 3, (37,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)  # drop_last=False, as torch's default
    sizes = []
    for model in (reference, OptimizedDDP(ours)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            sizes.append(len(x))
        if model is reference:
            expected = losses
    assert sizes[-1] == 5
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    _assert_state_close(ours, reference)


Pair = namedtuple("Pair", ["hidden", "count"])


@dataclasses.dataclass
class Result:
    loss: torch.Tensor
    logits: torch.Tensor
    pair: Pair
    note: str = "ok"


class Keyworded(torch.nn.Module):
    """forward takes tensors and non-tensors by keyword and returns a dataclass holding a named tuple, an int tensor
    and a string."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(5, 7)
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x, *, mask=None, labels=None, scale: float = 1.0, kind: str = "tanh"):
        h = getattr(torch, kind)(self.body(x)) * scale
        if mask is not None:
            h = h * mask[:, None]
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return Result(loss, logits, Pair(h, (mask > 0).sum(-1, keepdim=True) if mask is not None else None))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rows", [8, 6])
def test_keyword_arguments_and_structured_outputs(rows):
    torch.manual_seed(0)
    reference = Keyworded()
    ours = copy.deepcopy(reference)
    ddp = OptimizedDDP(ours)
    g = torch.Generator().manual_seed(2)
    x, labels = torch.randn(rows, 5, generator=g), torch.randint(0, 3, (rows,), generator=g)
    mask = (torch.rand(rows, generator=g) > 0.3).float()
    for kind in ("tanh", "sigmoid"):  # a string argument selects another program
        kw = {"mask": mask, "labels": labels, "scale": 0.5, "kind": kind}
        expected, got = reference(x, **kw), ddp(x, **kw)
        assert isinstance(got, Result) and isinstance(got.pair, Pair) and got.note == "ok"
        assert got.pair.count.dtype == torch.long and not got.pair.count.requires_grad
        torch.testing.assert_close(got.pair.count, expected.pair.count)
        np.testing.assert_allclose(got.logits.detach().numpy(), expected.logits.detach().numpy(), atol=1e-5)
        (expected.loss + expected.pair.hidden.pow(2).mean()).backward()  # two outputs reach the gradient
        (got.loss + got.pair.hidden.pow(2).mean()).backward()
        for (name, a), b in zip(reference.named_parameters(), ours.parameters(), strict=True):
            np.testing.assert_allclose(b.grad.numpy(), a.grad.numpy(), atol=1e-6, err_msg=name)
    with torch.no_grad():
        out = ddp(x)  # no mask, no labels: None fields stay None
    assert out.loss is None and out.pair.count is None
    with pytest.raises(BridgeError, match="must be hashable.*ndarray"):
        ddp(x, scale=np.ones(1))


@pytest.mark.timeout(300)
def test_gradient_reaches_inputs_that_require_it():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    ddp = OptimizedDDP(copy.deepcopy(lin))
    x = torch.randn(6, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ddp(x).pow(2).sum().backward()
    lin(x_ref).pow(2).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), x_ref.grad.numpy(), atol=1e-6)


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def _hf_batches(kind, sizes=(8, 6, 5)):
    g = torch.Generator().manual_seed(3)
    out = []
    for rows in sizes:
        ids = torch.randint(0, 96, (rows, 10), generator=g)
        mask = torch.ones(rows, 10, dtype=torch.long)
        mask[0, 6:] = 0  # a padded sequence
        labels = torch.randint(0, 3, (rows,), generator=g) if kind == "bert" else ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


@pytest.mark.slow  # 35-55 s on two shared CPU cores: two transformers, each traced for three batch sizes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_transformers_fine_tune_as_plain_torch(kind):
    """The Hugging Face loop (keyword batch, ``outputs.loss.backward()``), 5 AdamW steps on batches of 8, 6, 5, 8
    and 6 rows (a loss computed inside the model over the real rows only): losses and weights as plain torch's."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    reference = _bert() if kind == "bert" else _gpt2()
    ours = copy.deepcopy(reference)
    batches = _hf_batches(kind)
    batches += batches[:2]  # steps 4 and 5 see the batches of steps 1 and 2 again: their loss must have fallen
    results = []
    for model in (reference, OptimizedDDP(ours)):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        losses = []
        for batch in batches:
            outputs = model(**batch)
            outputs.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(outputs.loss.item())
        results.append(losses)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-4)
    assert results[0][3] < results[0][0] and results[0][4] < results[0][1]
    for (name, a), b in zip(reference.named_parameters(), ours.parameters(), strict=True):
        np.testing.assert_allclose(b.detach().numpy(), a.detach().numpy(), atol=1e-4, err_msg=name)


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # Python control flow on a computed value
            h = h * 2
        return h


class Indexed(torch.nn.Module):
    def forward(self, x):
        return x[: int(x.argmax())]  # a shape from a computed value


class OnCpu(torch.nn.Module):
    def forward(self, x):
        return x + torch.arange(x.shape[-1], device="cpu")


def test_what_cannot_be_lowered_is_a_typed_error():
    with pytest.raises(BridgeError, match=r"'Branchy' reads a tensor's value in Python at .*if h.sum\(\) > 0"):
        OptimizedDDP(Branchy())(torch.ones(8, 4))
    with pytest.raises(BridgeError, match=r"'Indexed' reads a tensor's value in Python at .*int\(x.argmax\(\)\)"):
        OptimizedDDP(Indexed())(torch.ones(8, 4))
    with pytest.raises(BridgeError, match=r"in module 'OnCpu' lives on torch's CPU device.*device=x.device"):
        OptimizedDDP(OnCpu())(torch.ones(8, 4))


class Counted(torch.nn.Module):
    """A linear layer whose forward, each time a compiled program runs it, ticks ``runs`` (a host callback)."""

    def __init__(self, runs: list) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.runs = runs

    def forward(self, x):
        from torchax.interop import call_jax

        def tick(a):
            jax.debug.callback(lambda: self.runs.append(1))
            return a

        return self.lin(call_jax(tick, x))


@pytest.mark.timeout(300)
def test_forward_runs_once_per_step():
    """The backward runs the VJP's residuals kept by the forward program, not the forward again."""
    import_torchax()
    runs: list = []
    ddp = OptimizedDDP(Counted(runs))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with torch.no_grad():
        ddp(torch.randn(8, 4))  # the forward alone: its ticks (one per device that runs it) are one run's
    jax.effects_barrier()
    once = len(runs)
    assert once >= 1
    for step in range(1, 4):
        opt.zero_grad()
        ddp(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        jax.effects_barrier()
        assert len(runs) == once * (step + 1)  # a backward that re-ran the forward would tick twice as often
    with pytest.raises(RuntimeError, match="a second time"):
        loss = ddp(torch.randn(8, 4)).sum()
        loss.backward(retain_graph=True)
        loss.backward()


class WithCounts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))

    def forward(self, x):
        out = self.net(x)
        return {"out": out, "argmax": out.argmax(-1), "unused": out.sum(0)}


@pytest.mark.timeout(300)
def test_steady_state_steps_make_no_implicit_transfers():
    """After the programs are compiled, training and evaluation steps (a full batch and a short one, an integer
    output, an output the loss ignores) move data only by explicit transfers: `jax.transfer_guard("disallow")`."""
    ddp = OptimizedDDP(WithCounts())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step(rows: int) -> None:
        opt.zero_grad()
        ddp(torch.randn(rows, 4))["out"].pow(2).mean().backward()
        opt.step()
        ddp.eval()
        with torch.no_grad():
            assert ddp(torch.randn(rows, 4))["argmax"].dtype == torch.long
        ddp.train()

    for rows in (8, 5):
        step(rows)  # compiles
    with jax.transfer_guard("disallow"):
        for rows in (8, 5, 8):
            step(rows)
    # nor explicit ones through the host: tensors cross by DLPack (zero-copy on the tensor's device), then move
    # device to device; outputs and gradients come back the same way
    with jax.transfer_guard_host_to_device("disallow_explicit"), jax.transfer_guard_device_to_host("disallow_explicit"):
        for rows in (8, 5, 8):
            step(rows)
