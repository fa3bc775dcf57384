"""The GPT demo trained from a torch DataLoader gives the native loader's losses (same corpus, same order)."""

import numpy as np
import pytest

from openhosti_jax import ArrayDataset, MeshConfig, build_mesh
from openhosti_jax.demo.gpt_job import GPTJob, build_job
from openhosti_jax.models.gpt import make_corpus

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def _losses(data, steps=5):
    job = GPTJob(steps=steps, global_batch=16, num_sequences=128, progress=False)
    state, _, step, _ = build_job(job, build_mesh(MeshConfig(data=2, fsdp=4)))
    out = []
    for _ in range(steps):
        state, m = step(state, next(data))
        out.append(float(m["loss"]))
    return out


@pytest.mark.slow  # 20 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_gpt_from_torch_dataloader_matches_native_loader():
    from torch.utils.data import DataLoader, TensorDataset

    from openhosti_jax.bridges import TorchLoader

    corpus = make_corpus(128, 32, seed=0)
    native = ArrayDataset({"tokens": corpus}, 16, shuffle=False)
    loader = DataLoader(TensorDataset(torch.from_numpy(corpus)), batch_size=16, shuffle=False)
    torch_losses = _losses(TorchLoader(loader, names=("tokens",)))
    native_losses = _losses(native)
    assert torch_losses == native_losses
    assert native_losses[-1] < native_losses[0]
    np.testing.assert_array_equal(next(iter(TorchLoader(loader, names=("tokens",))))["tokens"], corpus[:16])
