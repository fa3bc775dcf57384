"""PyTorch's "Quickstart" tutorial (FashionMNIST's MLP, its ``train`` and ``test`` functions as the tutorial
writes them) on synthetic 28x28 images: 150 examples in batches of 64, so each epoch ends on a short batch of 22.
Two epochs through OptimizedDDP give plain torch's weights, test loss and accuracy within 1e-4."""

import numpy as np
import pytest
import torch
from _torch_harness import assert_state_close, class_images, optimized, plain
from torch import nn
from torch.utils.data import DataLoader

pytestmark = pytest.mark.torch  # needs the torch extra

device = "cpu"


class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits


def train(dataloader, model, loss_fn, optimizer):
    model.train()
    for X, y in dataloader:
        X, y = X.to(device), y.to(device)
        pred = model(X)
        loss = loss_fn(pred, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test(dataloader, model, loss_fn):
    size = len(dataloader.dataset)
    num_batches = len(dataloader)
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for X, y in dataloader:
            X, y = X.to(device), y.to(device)
            pred = model(X)
            test_loss += loss_fn(pred, y).item()
            correct += (pred.argmax(1) == y).type(torch.float).sum().item()
    return test_loss / num_batches, correct / size


test.__test__ = False  # the tutorial's name; not a pytest test


def main(wrap):
    torch.manual_seed(0)
    training_data = class_images(150, (1, 28, 28), 10, seed=1)
    test_data = class_images(100, (1, 28, 28), 10, seed=2)
    train_dataloader = DataLoader(training_data, batch_size=64)
    test_dataloader = DataLoader(test_data, batch_size=64)
    model = wrap(NeuralNetwork().to(device))  # the DDP line
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    results = [test(test_dataloader, model, loss_fn)]
    for _ in range(2):
        train(train_dataloader, model, loss_fn, optimizer)
        results.append(test(test_dataloader, model, loss_fn))
    return model.state_dict(), results


@pytest.mark.timeout(600)
def test_quickstart_as_plain_torch():
    expected_state, expected = main(plain)
    state, results = main(optimized)
    assert_state_close(state, expected_state)
    np.testing.assert_allclose(results, expected, rtol=1e-4)
    assert expected[-1][0] < expected[0][0]  # the test loss fell
