"""The three single-file examples: loss falls, and 8 sharded devices give the same losses as one device."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

TINY = {
    "linen_mlp": {"batch": 16, "width": 16, "depth": 2},
    "bert_classify": {"batch": 16, "d_model": 16, "layers": 1},
    "diffusion_unet": {"batch": 16, "channels": 4},
}


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # linen dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 76 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(TINY))
def test_example_loss_falls_and_matches_one_device(name):
    ex = load(name)
    sharded = np.array(ex.train(steps=12, progress=False, **TINY[name]))
    single = np.array(ex.train(steps=12, progress=False, devices=jax.devices()[:1], **TINY[name]))
    assert np.all(np.isfinite(sharded))
    np.testing.assert_allclose(sharded, single, rtol=1e-4)
    assert sharded[-3:].mean() < sharded[:3].mean()
