"""OptimizedDDP's full mode against plain torch on one process (8 devices): BatchNorm statistics, train/eval mode,
gradient accumulation over microbatches, checkpoint save/resume and the state-dict round trip."""

import copy
import importlib.util
import shutil
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:  # imported through the shim only: plain import fails on torch 2.13
    pytest.skip("needs torchax (the torch extra)", allow_module_level=True)

from openhosti_jax.errors import BatchError, BridgeError  # noqa: E402
from openhosti_jax.frontends.torch_ddp import OptimizedDDP  # noqa: E402

pytestmark = pytest.mark.torch  # needs the torch extra


class ConvNet(torch.nn.Module):
    """Conv, BatchNorm, linear head. The conv has no bias: BatchNorm subtracts it, so its gradient is exactly zero and
    Adam would amplify the float noise of that zero into steps of size lr."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class TinyGPT(torch.nn.Module):
    """An embedding tied to the head around one transformer encoder layer. ``bias=False`` drops the attention's key
    bias, whose gradient is exactly zero (softmax ignores a shift common to a query's scores): Adam would turn the
    float noise of that zero into steps of size lr."""

    def __init__(self, vocab: int = 256, d: int = 32, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.block = torch.nn.TransformerEncoderLayer(d, 4, 64, dropout=dropout, batch_first=True, bias=bias)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def _ce(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _images(n: int = 5, rows: int = 16, seed: int = 2) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 3, 6, 6, generator=g), torch.randint(0, 5, (rows,), generator=g)) for _ in range(n)]


def _tokens(n: int = 5, rows: int = 16, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 256, (rows, 12), generator=g), torch.randint(0, 256, (rows, 12), generator=g))
        for _ in range(n)
    ]


def _torch_steps(model, opt, batches, accumulate: int = 1) -> list[float]:
    """Plain torch; ``accumulate`` > 1 sums the gradients of microbatch i = rows i, i + k, ... of each loss / k."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for i in range(accumulate):
            loss = _ce(model(x[i::accumulate]), y[i::accumulate]) / accumulate
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses


def _assert_state_close(ours: torch.nn.Module, reference: torch.nn.Module, atol: float = 1e-5) -> None:
    for (name, a), b in zip(reference.state_dict().items(), ours.state_dict().values(), strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=atol, err_msg=name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["fsdp", "auto"])
def test_batch_norm_statistics_and_modes_follow_torch(plan):
    """AdamW on a conv net with BatchNorm: parameters, running statistics and the batch counter as plain torch's after
    5 steps; eval() then runs on the running statistics (forward and train_step), and train() goes back."""
    torch.manual_seed(0)
    reference = ConvNet()
    ours = copy.deepcopy(reference)
    batches = _images()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = _torch_steps(reference, reference_opt, batches)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ddp = OptimizedDDP(ours, optimizer=opt, criterion=torch.nn.functional.cross_entropy, plan=plan)
    got = [float(ddp.train_step(x, y)) for x, y in batches]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    ddp.state_dict()
    _assert_state_close(ours, reference)
    assert int(ours.bn.num_batches_tracked) == 5
    assert float(ours.bn.running_var.std()) > 0  # the statistics moved

    ddp.eval()
    reference.eval()
    x, y = _images(1, seed=9)[0]
    with torch.no_grad():
        np.testing.assert_allclose(ddp(x).numpy(), reference(x).numpy(), rtol=1e-4, atol=1e-5)
    before = ours.bn.running_mean.clone()
    expected_eval = _torch_steps(reference, reference_opt, [(x, y)])
    np.testing.assert_allclose(float(ddp.train_step(x, y)), expected_eval[0], rtol=1e-5)
    ddp.state_dict()
    torch.testing.assert_close(ours.bn.running_mean, before, rtol=0, atol=0)  # eval mode leaves the statistics
    assert int(ours.bn.num_batches_tracked) == 5
    ddp.train()
    with torch.no_grad():
        ddp(x)  # a training-mode forward updates the statistics, and the next train_step starts from them
    ddp.train_step(x, y)
    ddp.state_dict()
    assert int(ours.bn.num_batches_tracked) == 7
    reference.train()
    with torch.no_grad():
        reference(x)
    _torch_steps(reference, reference_opt, [(x, y)])
    _assert_state_close(ours, reference)  # after train, eval, a forward and train again: still as torch


@pytest.mark.slow  # 14 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_microbatches_accumulate_as_torch_does():
    """microbatch=2: the same losses as one batch (a transformer), and on BatchNorm the running statistics
    updated once per microbatch, as torch's own gradient-accumulation loop updates them."""
    torch.manual_seed(0)
    gpt = TinyGPT()
    batches = _tokens(3)

    def full(model, **kw):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return OptimizedDDP(model, optimizer=opt, criterion=_ce, **kw)

    whole, split = full(copy.deepcopy(gpt)), full(copy.deepcopy(gpt), microbatch=2)
    a = [float(whole.train_step(x, y)) for x, y in batches]
    b = [float(split.train_step(x, y)) for x, y in batches]
    assert split.num_microbatches == 2 and whole.num_microbatches == 1
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert a[-1] < a[0]

    reference = ConvNet()
    ours = copy.deepcopy(reference)
    images = _images(3)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = _torch_steps(reference, reference_opt, images, accumulate=2)
    ddp = OptimizedDDP(
        ours,
        optimizer=torch.optim.AdamW(ours.parameters(), lr=1e-2),
        criterion=torch.nn.functional.cross_entropy,
        microbatch=2,
    )
    np.testing.assert_allclose([float(ddp.train_step(x, y)) for x, y in images], expected, rtol=1e-5)
    ddp.state_dict()
    _assert_state_close(ours, reference)
    assert int(ours.bn.num_batches_tracked) == 6
    x, y = _images(1, rows=24, seed=4)[0]  # the microbatch size (1 row per device) stays: 3 microbatches of 8 now
    expected = _torch_steps(reference, reference_opt, [(x, y)], accumulate=3)  # BatchNorm: the loss tells 3 from 2
    assert float(ddp.train_step(x, y)) == pytest.approx(expected[0], rel=1e-5)
    ddp.state_dict()
    _assert_state_close(ours, reference)
    net = ConvNet()
    odd = OptimizedDDP(
        net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        criterion=torch.nn.functional.cross_entropy,
        microbatch=3,
    )
    with pytest.raises(BatchError, match="do not divide the per-device batch 2"):
        odd.train_step(*images[0])


@pytest.mark.slow  # 24 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_auto_microbatch_fits_the_memory_budget():
    """microbatch="auto": with room to spare the whole per-device batch (8 rows) runs at once; with a budget of that
    step's own compiled peak it no longer fits (10% is kept free), so a smaller microbatch is chosen by AOT compiles,
    and the losses stay those of the whole batch."""
    torch.manual_seed(0)
    gpt = TinyGPT()
    batches = _tokens(2, rows=64)

    def full(**kw):
        model = copy.deepcopy(gpt)
        return OptimizedDDP(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), criterion=_ce, **kw)

    roomy = full(microbatch="auto", memory_budget=2**40)
    expected = [float(roomy.train_step(x, y)) for x, y in batches]
    assert roomy.microbatch_choice.size == 8 and roomy.num_microbatches == 1
    tight = full(microbatch="auto", memory_budget=roomy.microbatch_choice.peak_bytes)
    got = [float(tight.train_step(x, y)) for x, y in batches]
    choice = tight.microbatch_choice
    assert choice.size < 8 and choice.peak_bytes <= choice.limit_bytes
    assert tight.num_microbatches == 8 // choice.size
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.slow  # 60 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_checkpoint_resumes_bit_identically(tmp_path):
    """Saved every 3 steps (parameters, AdamW moments, the dropout key); a fresh OptimizedDDP over a module with other
    weights resumes from step 3 and gives steps 4 and 5 the very losses and weights of the uninterrupted run."""
    torch.manual_seed(0)
    batches = _tokens(5)

    def make(seed: int) -> OptimizedDDP:
        torch.manual_seed(seed)
        model = TinyGPT(dropout=0.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return OptimizedDDP(
            model,
            optimizer=opt,
            criterion=_ce,
            checkpoint_dir=tmp_path / "local",
            every_steps=3,
            replicate_to=tmp_path / "replica",
        )

    first = make(0)
    losses = [float(first.train_step(x, y)) for x, y in batches]
    first.close()
    assert first.module.training and losses[-1] < losses[0]
    shutil.rmtree(tmp_path / "local")  # the machine was replaced: only the replica survives
    resumed = make(1)
    assert resumed.checkpoints.fetched_step == 3
    assert resumed.checkpoints.latest_good_step() == 3
    again = [float(resumed.train_step(x, y)) for x, y in batches[3:]]
    assert again == losses[3:]
    for (name, a), b in zip(first.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert resumed.save_checkpoint() == 5
    assert resumed.checkpoints.good_steps()[-1] == 5
    resumed.close()


@pytest.mark.slow  # 7 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_state_dict_round_trip_and_direct_module_changes():
    """state_dict() of a trained model loaded into another full-mode model (before and after its first step) makes it
    compute the same loss; its optimizer state stays its own. load_module() takes a module changed directly."""
    torch.manual_seed(0)
    batches = _images(4)

    def make(seed: int) -> OptimizedDDP:
        torch.manual_seed(seed)
        model = ConvNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return OptimizedDDP(model, optimizer=opt, criterion=torch.nn.functional.cross_entropy)

    trained = make(0)
    for x, y in batches[:3]:
        trained.train_step(x, y)
    saved = {k: v.clone() for k, v in trained.state_dict().items()}
    expected = float(trained.train_step(*batches[3]))

    fresh = make(1)
    fresh.load_state_dict(saved)  # before any step
    assert float(fresh.train_step(*batches[3])) == pytest.approx(expected, rel=1e-6)
    stepped = make(2)
    stepped.train_step(*batches[0])  # its train state exists: the load replaces it
    stepped.load_state_dict(saved)
    for k, v in stepped.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)
    assert float(stepped.train_step(*batches[3])) == pytest.approx(expected, rel=1e-6)

    stepped.module.load_state_dict({k.removeprefix("module."): v for k, v in saved.items()})
    stepped.load_module()
    assert float(stepped.train_step(*batches[3])) == pytest.approx(expected, rel=1e-6)


def test_full_mode_options_are_checked():
    model = ConvNet()
    with pytest.raises(BridgeError, match="belong to the full mode"):
        OptimizedDDP(model, microbatch=2)
    with pytest.raises(BridgeError, match=r"\['plan'\] belong to the full mode"):  # DDP's weights are torch's
        OptimizedDDP(model, plan="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(BridgeError, match="pass checkpoint_dir= too"):
        OptimizedDDP(model, optimizer=opt, criterion=torch.nn.functional.cross_entropy, every_steps=2)
    ddp = OptimizedDDP(model, optimizer=opt, criterion=torch.nn.functional.cross_entropy)
    with pytest.raises(BridgeError, match="found no checkpoint_dir"):
        ddp.save_checkpoint()


@pytest.mark.slow  # 10 s a plan on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_balanced_full_mode_equals_torch_and_moves_work_off_a_slow_device(plan):
    """balance=True on 4 devices, the last stalled 3 x 10 ms per microbatch: 4 AdamW steps of the transformer give
    plain torch's losses and weights, and the balancer hands the slow device fewer of the 16 microbatches; with
    parameters replicated, and sharded by ZeRO-3 (gathered in the step, the gradient reduce-scattered)."""
    import jax

    from openhosti_jax import MeshConfig, build_mesh
    from openhosti_jax.balance import Throttle

    torch.manual_seed(0)
    reference = TinyGPT(bias=False)
    ours = copy.deepcopy(reference)
    batches = _tokens(4, rows=32)
    # lr 3e-3: at 1e-2 Adam blows a rare token's float noise up to 2e-5 in 4 steps, the plain full mode's too
    expected = _torch_steps(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1), batches)
    mesh = build_mesh(MeshConfig(data=4), devices=jax.devices()[:4])
    slow = Throttle.for_devices(4, {3: 4}, microbatch_seconds=0.01)
    opt = torch.optim.AdamW(ours.parameters(), lr=3e-3, weight_decay=0.1)
    ddp = OptimizedDDP(
        ours,
        mesh,
        optimizer=opt,
        criterion=_ce,
        plan=plan,
        balance=True,
        balance_microbatches=16,
        every=1,
        throttle=slow,
    )
    got = [float(ddp.train_step(x, y)) for x, y in batches]
    assert ddp._full["plan"].zero_stage == (3 if plan == "fsdp" else 0)
    if plan == "fsdp":  # some parameter really is sharded over the data axis between steps
        assert any("data" in str(a.sharding.spec) for a in jax.tree.leaves(ddp.full_state.params))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert got[-1] < got[0]
    ddp.state_dict()
    _assert_state_close(ours, reference)
    counts = ddp.balancer.counts
    assert ddp.num_microbatches == 16 and sum(counts) == 16
    assert counts[3] == min(counts) and counts[3] < 4, counts


def test_balanced_full_mode_refuses_buffers_and_stray_options():
    """BatchNorm's buffers (named, with the SyncBatchNorm reason), the plain mode's microbatch=, unknown balancer
    keywords, balancer keywords without balance=True and the options' former names are refused before any step."""
    net = ConvNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ce = torch.nn.functional.cross_entropy
    with pytest.raises(BridgeError, match=r"cannot carry module buffers.*SyncBatchNorm.*'bn.running_mean'"):
        OptimizedDDP(net, optimizer=opt, criterion=ce, balance=True)
    gpt = TinyGPT()
    opt = torch.optim.SGD(gpt.parameters(), lr=0.1)
    # microbatch= (accumulation steps of the unbalanced step) and balance_microbatches= (pieces the balancer
    # spreads) are two different counts: mixing them is refused, naming both
    for kw in ({"microbatch": 2}, {"microbatch": 2, "balance_microbatches": 8}):
        with pytest.raises(BridgeError, match=r"balance_microbatches= pieces.*found microbatch=2"):
            OptimizedDDP(gpt, optimizer=opt, criterion=_ce, balance=True, **kw)
    with pytest.raises(BridgeError, match=r"found \['evry'\]"):
        OptimizedDDP(gpt, optimizer=opt, criterion=_ce, balance=True, evry=1)
    with pytest.raises(
        BridgeError, match=r"\['balance_microbatches'\] configure the load-balanced.*found balance=False"
    ):
        OptimizedDDP(gpt, optimizer=opt, criterion=_ce, balance_microbatches=8)
    with pytest.raises(BridgeError, match=r"expected balance_microbatches= an int >= 1"):
        OptimizedDDP(gpt, optimizer=opt, criterion=_ce, balance=True, balance_microbatches=0)
    # the former names say what they are called now
    with pytest.raises(
        BridgeError, match=r"\['loss_fn', 'microbatches'\] are named \['balance_microbatches', 'criterion'\]"
    ):
        OptimizedDDP(gpt, optimizer=opt, loss_fn=_ce, balance=True, microbatches=8)
    with pytest.raises(BridgeError, match="belong to the full mode"):
        OptimizedDDP(gpt, balance=True)


@pytest.mark.slow  # 16 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["step", "onecycle"])
def test_full_mode_follows_torch_lr_schedulers(schedule):
    """The loop steps a torch scheduler after each train_step: StepLR's decays, and OneCycleLR's rate and cycled
    Adam beta1, reach every step (read from param_groups) without a retrace; 6 steps as plain torch's within 1e-5."""
    torch.manual_seed(0)
    reference = TinyGPT(bias=False)
    ours = copy.deepcopy(reference)
    batches = _tokens(6)

    def scheduled(model):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        if schedule == "step":
            return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=6)

    opt, sched = scheduled(reference)
    expected = []
    for x, y in batches:
        expected += _torch_steps(reference, opt, [(x, y)])
        sched.step()
    traced = []

    def loss(out, targets):
        traced.append(1)  # runs when a program is traced, not when it runs
        return _ce(out, targets)

    opt, sched = scheduled(ours)
    ddp = OptimizedDDP(ours, optimizer=opt, criterion=loss)
    got, rates = [], []
    for x, y in batches:
        got.append(float(ddp.train_step(x, y)))
        if len(got) == 1:
            traces = len(traced)
        rates.append(opt.param_groups[0]["lr"])
        with warnings.catch_warnings():  # no "lr_scheduler.step() before optimizer.step()": the optimizer stepped
            warnings.simplefilter("error", UserWarning)
            sched.step()
    assert len(set(rates)) >= 3 and len(traced) == traces
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    ddp.state_dict()
    _assert_state_close(ours, reference)


@pytest.mark.slow  # 16 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["fsdp", "dp"])
def test_full_mode_takes_a_dataloaders_short_last_batch(plan):
    """37 images in batches of 8 (the last one 5 rows, fewer than the 8 devices), two epochs: the short batch is
    split unevenly inside its own program; losses, weights and BatchNorm statistics equal plain torch's."""
    torch.manual_seed(0)
    reference = ConvNet()
    ours = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(37, 3, 6, 6, generator=g), torch.randint(0, 5, (37,), generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    expected = _torch_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), [*loader] * 2)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ddp = OptimizedDDP(ours, optimizer=opt, criterion=torch.nn.functional.cross_entropy, plan=plan)
    got = [float(ddp.train_step(x, y)) for _ in range(2) for x, y in loader]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    ddp.state_dict()
    _assert_state_close(ours, reference)
    assert int(ours.bn.num_batches_tracked) == 10


@pytest.mark.slow  # four compiles of a small MLP
@pytest.mark.timeout(600)
@pytest.mark.parametrize("options", [{"microbatch": 2}, {"balance": True, "balance_microbatches": 8, "plan": "dp"}])
def test_a_short_last_batch_with_accumulation_or_balancing_equals_torch(options):
    """37 rows in batches of 16 (the last one 5: fewer than the devices, not a multiple of the microbatches or the
    balancer's pieces), two epochs: the full batches accumulate (or are balanced), the short one runs whole, and
    losses and weights equal plain torch's over the same batches."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    ours = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(4)
    data = torch.utils.data.TensorDataset(torch.randn(37, 6, generator=g), torch.randint(0, 5, (37,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    expected = _torch_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), [*loader] * 2)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ddp = OptimizedDDP(ours, optimizer=opt, criterion=torch.nn.functional.cross_entropy, **options)
    got = [float(ddp.train_step(x, y)) for _ in range(2) for x, y in loader]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    ddp.state_dict()
    _assert_state_close(ours, reference)
