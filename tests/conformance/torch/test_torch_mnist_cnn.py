"""PyTorch's ``examples/mnist`` (its ``Net`` with a BatchNorm added after each convolution, Dropout, log-softmax and
``F.nll_loss``; Adadelta with ``StepLR`` per epoch; ``train`` and ``test`` as the example writes them, ``model.eval()``
and ``torch.no_grad()`` for testing) on synthetic 12x12 images of 4 classes. Dropout draws its masks from JAX's
generator, so the runs differ: through OptimizedDDP the training loss falls and the held-out accuracy is well above
chance (0.25), as plain torch's; BatchNorm's running statistics are those eval uses."""

import pytest
import torch
import torch.nn.functional as F
from _torch_harness import class_images, optimized, plain
from torch import nn
from torch.optim.lr_scheduler import StepLR

pytestmark = pytest.mark.torch  # needs the torch extra


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.bn2 = nn.BatchNorm2d(16)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(self.bn1(x))
        x = self.conv2(x)
        x = F.relu(self.bn2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(model, device, train_loader, optimizer):
    model.train()
    losses = []
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    return test_loss / len(test_loader.dataset), correct / len(test_loader.dataset)


test.__test__ = False  # the example's name; not a pytest test


def main(wrap):
    torch.manual_seed(1)
    device = torch.device("cpu")
    train_loader = torch.utils.data.DataLoader(class_images(250, (1, 12, 12), 4, seed=3), batch_size=64, shuffle=True)
    test_loader = torch.utils.data.DataLoader(class_images(200, (1, 12, 12), 4, seed=4), batch_size=100)
    model = wrap(Net().to(device))  # the DDP line
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for _ in range(3):
        losses += train(model, device, train_loader, optimizer)
        scheduler.step()
    return losses, test(model, device, test_loader)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "wrap", [plain, pytest.param(optimized, marks=pytest.mark.slow)], ids=["torch", "optimized_ddp"]
)  # ~30 s
def test_mnist_example_learns(wrap):
    losses, (test_loss, accuracy) = main(wrap)
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4
    assert accuracy > 0.8, accuracy
