"""The PyTorch conformance check: a canonical PyTorch example run twice, as written (plain torch on one device) and
with its DDP line changed to ``OptimizedDDP(...)`` (8 simulated devices), the two results compared.

Each example is a function of ``wrap``, the one line PyTorch users change: ``model = wrap(Net())`` where DDP code
writes ``model = DistributedDataParallel(Net())``."""

from typing import Any

import numpy as np
import torch

from openhosti_jax.frontends.torch_ddp import OptimizedDDP

TOLERANCE = 1e-4


def plain(model: torch.nn.Module) -> torch.nn.Module:
    """The reference: the model itself, on torch's CPU device."""
    return model


def optimized(model: torch.nn.Module) -> torch.nn.Module:
    """The DDP line, changed."""
    return OptimizedDDP(model)


def assert_state_close(ours: dict[str, Any], reference: dict[str, Any], atol: float = TOLERANCE) -> None:
    """Two state dicts (keys with or without DDP's ``module.`` prefix) equal within ``atol``."""
    ours = {k.removeprefix("module."): v for k, v in ours.items()}
    reference = {k.removeprefix("module."): v for k, v in reference.items()}
    assert ours.keys() == reference.keys()
    for k, v in reference.items():
        np.testing.assert_allclose(ours[k].detach().numpy(), v.detach().numpy(), atol=atol, rtol=atol, err_msg=k)


def class_images(n: int, shape: tuple[int, ...], classes: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` noisy images whose class is a bright patch's position: learnable, so accuracy well above chance is
    a real result (chance is ``1 / classes``)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    images = 0.5 * torch.randn(n, *shape, generator=g)
    width = shape[-1] // classes
    for i, c in enumerate(labels.tolist()):
        images[i, ..., c * width : (c + 1) * width] += 1.0
    return torch.utils.data.TensorDataset(images, labels)
