"""The SDXL-layout UNet: parameter counts in closed form against the built modules, a diffusion training step whose
gradient is finite and whose loss falls, and planning it from abstract shapes."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from openhosti_jax.errors import StateError
from openhosti_jax.models.presets import model_preset
from openhosti_jax.models.unet import UNet, UNetConfig, timestep_embedding
from openhosti_jax.planner.predict import predict
from openhosti_jax.planner.workload import workload


def _count(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize(
    "shape",
    [{}, {"transformer_depth": (1, 0)}, {"channels": (16, 32, 48), "transformer_depth": (0, 1, 2), "adm_dim": 0}],
)
def test_closed_form_counts_the_built_parameters(shape):
    cfg = UNetConfig.tiny(**shape)
    assert _count(nnx.eval_shape(lambda: UNet(cfg, rngs=nnx.Rngs(0)))) == cfg.num_params()


def test_sdxl_has_sdxl_size():
    # SDXL's UNet has 2.567B parameters (Podell et al. 2023, Table 1: 2.6B); nnx.eval_shape of this module gave
    # 2,567,463,684, as the closed form does
    assert UNetConfig.sdxl().num_params() == pytest.approx(2.567e9, rel=1e-3)
    assert model_preset("sdxl-unet").tokens_per_example == 128 * 128
    with pytest.raises(StateError, match="no fields"):
        model_preset("sdxl-unet", seq_len=4096)


def test_a_diffusion_step_trains():
    cfg = UNetConfig.tiny()
    model = UNet(cfg, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(1), 4)
    batch = {k: jax.random.normal(r, s.shape) for (k, s), r in zip(cfg.sample_batch(4).items(), keys, strict=True)}
    batch["timesteps"] = jnp.arange(4.0) * 100
    noise = jax.random.normal(jax.random.key(2), batch["latents"].shape)
    graph, params = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-3)
    opt = tx.init(params)

    def loss(p):
        return jnp.mean((nnx.merge(graph, p)(batch) - noise) ** 2)

    losses, grad_fn = [], jax.jit(jax.value_and_grad(loss))
    for _ in range(5):
        value, grads = grad_fn(params)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    assert losses[-1] < losses[0]


def test_timestep_embedding_is_cosines_then_sines():
    e = timestep_embedding(jnp.array([0.0, 3.0]), 8)
    assert e.shape == (2, 8)
    assert jnp.allclose(e[0], jnp.array([1.0] * 4 + [0.0] * 4))
    assert float(e[1, 0]) == pytest.approx(float(jnp.cos(3.0)))


def test_planned_from_abstract_shapes():
    """The tiny UNet's traced FLOPs and a plan for it on 8 H100, from shapes alone (position = latent pixel)."""
    cfg = UNetConfig.tiny()
    w = workload(lambda r: UNet(cfg, rngs=nnx.Rngs(r)), cfg.sample_batch(16))
    assert w.tokens_per_example == cfg.latent_size**2 and w.flops_per_example > 0
    p = predict(
        lambda r: UNet(cfg, rngs=nnx.Rngs(r)), optax.adamw(1e-4), cfg.sample_batch(16), "8xH100", pipeline=False
    )
    assert p.fits and p.tokens_per_step == 16 * cfg.latent_size**2 and 0 < p.mfu < 1
