"""The DDP tutorial's checkpointing ("Save and Load Checkpoints"): train, ``torch.save(ddp_model.state_dict(),
CHECKPOINT_PATH)``, load it into a new model with ``ddp_model.load_state_dict(torch.load(CHECKPOINT_PATH,
map_location=...))``, and keep training; then the saving tutorial's ``model.module.state_dict()`` loaded into a plain
module for inference. Through OptimizedDDP every weight, loss and prediction is plain torch's within 1e-4 (keys
under ``module.``, as DDP's)."""

import numpy as np
import pytest
import torch
from _torch_harness import assert_state_close, optimized, plain
from torch import nn

pytestmark = pytest.mark.torch  # needs the torch extra


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def train(ddp_model, steps, seed):
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=g))
        labels = torch.randn(20, 5, generator=g)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(wrap, checkpoint_path):
    torch.manual_seed(0)
    ddp_model = wrap(ToyModel())  # the DDP line
    losses = train(ddp_model, 3, seed=1)
    torch.save(ddp_model.state_dict(), checkpoint_path)
    map_location = {"cuda:0": "cpu"}
    torch.manual_seed(7)
    ddp_model = wrap(ToyModel())  # the DDP line, again for the new model
    ddp_model.load_state_dict(torch.load(checkpoint_path, map_location=map_location))
    losses += train(ddp_model, 3, seed=2)
    inference = ToyModel()
    inference.load_state_dict(ddp_model.module.state_dict())
    inference.eval()
    with torch.no_grad():
        predictions = inference(torch.ones(3, 10))
    return ddp_model.state_dict(), losses, predictions


@pytest.mark.timeout(600)
def test_save_and_load_as_plain_torch(tmp_path):
    # the reference: the module under a wrapper that has DDP's ``.module`` and ``module.`` keys, as DDP on one device
    expected_state, expected, expected_predictions = main(_with_module, tmp_path / "plain.pt")
    state, losses, predictions = main(optimized, tmp_path / "ddp.pt")
    assert set(state) == set(expected_state) and all(k.startswith("module.") for k in state)
    assert_state_close(state, expected_state)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    np.testing.assert_allclose(predictions.numpy(), expected_predictions.numpy(), atol=1e-4)


class _Wrapped(nn.Module):
    """What DDP is on one device: the module under ``.module``, its state-dict keys under ``module.``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _with_module(model):
    return _Wrapped(plain(model))
