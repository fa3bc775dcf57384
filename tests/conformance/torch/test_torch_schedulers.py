"""The loop of ``torch.optim``'s documentation, "How to adjust learning rate": a model, SGD with momentum, two
schedulers chained (``ExponentialLR`` then ``MultiStepLR``, each stepped once per epoch after the batches), 4 epochs
over a DataLoader whose last batch is short. Through OptimizedDDP the losses and weights are plain torch's within
1e-4, and the rates followed the schedule."""

import numpy as np
import pytest
import torch
from _torch_harness import assert_state_close, optimized, plain
from torch.optim.lr_scheduler import ExponentialLR, MultiStepLR

pytestmark = pytest.mark.torch  # needs the torch extra


def main(wrap):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(60, 8, generator=g)
    y = x @ torch.randn(8, 2, generator=g) + 0.1 * torch.randn(60, 2, generator=g)
    dataset = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = wrap(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)))  # DDP line
    loss_fn = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler1 = ExponentialLR(optimizer, gamma=0.9)
    scheduler2 = MultiStepLR(optimizer, milestones=[2, 3], gamma=0.1)
    losses, rates = [], []
    for _epoch in range(4):
        for input, target in dataset:
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        scheduler1.step()
        scheduler2.step()
        rates.append(optimizer.param_groups[0]["lr"])
    return model.state_dict(), losses, rates


@pytest.mark.timeout(600)
def test_chained_schedulers_as_plain_torch():
    expected_state, expected, expected_rates = main(plain)
    state, losses, rates = main(optimized)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert rates == expected_rates and len(set(rates)) == 4
    assert_state_close(state, expected_state)
    assert expected[-1] < 0.5 * expected[0]
