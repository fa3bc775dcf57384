"""OptimizedDDP checkpoints save the DataLoader's position (epoch, batch, seed): a run stopped mid-epoch and resumed
by a fresh OptimizedDDP over a fresh DataLoader (a ``DistributedSampler`` that shuffles by epoch) trains on exactly
the uninterrupted run's remaining batches, in its order, with its losses and final weights bit for bit."""

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from openhosti_jax.frontends.torch_ddp import OptimizedDDP  # noqa: E402

pytestmark = pytest.mark.torch
EPOCHS, STOP_AFTER = 2, 7  # 5 batches an epoch: stopped after batch 2 of epoch 1


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g)
    ds = TensorDataset(x, y, torch.arange(40))
    return DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3))


def _model(directory, seed: int) -> OptimizedDDP:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    return OptimizedDDP(
        module,
        optimizer=opt,
        criterion=torch.nn.functional.cross_entropy,
        plan="dp",
        checkpoint_dir=directory,
        every_steps=1,
    )


def _train(model: OptimizedDDP, stop_after: int | None = None) -> tuple[list[float], list[list[int]]]:
    losses, seen = [], []
    for x, y, idx in model.loader(_loader(), num_epochs=EPOCHS, seed=5):
        losses.append(float(model.train_step(x, y)))
        seen.append(idx.tolist())
        if len(losses) == stop_after:
            break
    return losses, seen


@pytest.mark.slow  # 27 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_a_run_stopped_mid_epoch_resumes_at_the_next_batch_of_that_epoch(tmp_path):
    reference = _model(tmp_path / "reference", seed=0)
    ref_losses, ref_seen = _train(reference)
    reference.close()
    assert len(ref_losses) == 10 and ref_seen[0] != ref_seen[5]  # the sampler's epoch changed the order
    assert sorted(sum(ref_seen[:5], [])) == sorted(sum(ref_seen[5:], [])) == list(range(40))

    first = _model(tmp_path / "run", seed=0)
    losses, seen = _train(first, stop_after=STOP_AFTER)
    first.checkpoints.wait()
    assert first.checkpoints.latest_good_step() == STOP_AFTER
    del first  # the process is gone: no close, the last save is what survives

    resumed = _model(tmp_path / "run", seed=1)  # other initial weights: they must all come from the checkpoint
    more, more_seen = _train(resumed)
    assert resumed.checkpoints.restored_step == STOP_AFTER
    assert seen + more_seen == ref_seen  # no sample lost or repeated, in the uninterrupted order
    assert losses + more == ref_losses  # bit for bit
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    resumed.close()
