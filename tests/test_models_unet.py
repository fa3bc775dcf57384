"""The SDXL-layout UNet: parameter counts and FLOPs in closed form against the built modules and their traced
matmuls, a diffusion training step whose gradient is finite and whose loss falls, query-blocked attention equal to
the whole square, and planning an SDXL-shaped UNet from abstract shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from openhosti_jax.errors import ConfigError
from openhosti_jax.flops import count_flops
from openhosti_jax.models.presets import model_preset
from openhosti_jax.models.unet import UNet, UNetConfig, timestep_embedding
from openhosti_jax.planner.predict import predict

SHAPES = [
    {},
    {"transformer_depth": (1, 0)},
    {"channels": (16, 32, 48), "transformer_depth": (0, 1, 2), "adm_dim": 0},
    {"attention_block": 4},
]


def _count(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _abstract(cfg: UNetConfig) -> UNet:
    return nnx.eval_shape(lambda: UNet(cfg, rngs=nnx.Rngs(0)))


def _filled(cfg: UNetConfig) -> UNet:
    """A UNet with numpy-drawn weights (kernels normal / sqrt(fan-in), biases 0, norm scales 1): no initialiser
    is compiled, which on CPU takes longer than the training step."""
    graph, state = nnx.split(_abstract(cfg))
    rng = np.random.default_rng(0)

    def fill(path: tuple, x: jax.ShapeDtypeStruct) -> jax.Array:
        name = str(path[-1])
        if "kernel" in name:
            return jnp.asarray(rng.normal(size=x.shape) / np.sqrt(np.prod(x.shape[:-1])), x.dtype)
        return jnp.full(x.shape, 1.0 if "scale" in name else 0.0, x.dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state)))
    return nnx.merge(graph, state)


@pytest.mark.parametrize("shape", SHAPES)
def test_closed_forms_count_the_built_parameters_and_traced_flops(shape):
    cfg = UNetConfig.tiny(**shape)
    model = _abstract(cfg)
    assert _count(model) == cfg.num_params()
    graph, state = nnx.split(model)
    forward = jax.make_jaxpr(lambda s, b: nnx.merge(graph, s)(b))(state, cfg.sample_batch(1))
    assert 3 * count_flops(forward, matmul_only=True) == cfg.flops_per_example()
    assert cfg.flops_per_token() == cfg.flops_per_example() / cfg.latent_size**2


def test_sdxl_has_sdxl_size():
    """SDXL's UNet has 2.567B parameters (Podell et al. 2023, Table 1: 2.6B): the closed form and the module built
    abstractly count 2,567,463,684."""
    cfg = UNetConfig.sdxl()
    built = _count(_abstract(cfg))
    print(f"SDXL UNet: {built:,} parameters, {cfg.flops_per_example() / 1e12:.2f} TFLOPs per training example")
    assert built == cfg.num_params() == pytest.approx(2.567e9, rel=1e-3)
    m = model_preset("sdxl-unet")
    assert m.tokens_per_example == 128 * 128 and m.config.attention_block == 512
    assert m.flops_per_token == cfg.flops_per_example() / 128**2
    with pytest.raises(ConfigError, match="no fields"):
        model_preset("sdxl-unet", seq_len=4096)


@pytest.mark.slow  # 37 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(180)
def test_a_diffusion_step_trains_and_blocked_attention_is_exact():
    cfg = UNetConfig.tiny()
    model = _filled(cfg)
    keys = jax.random.split(jax.random.key(1), 4)
    batch = {k: jax.random.normal(r, s.shape) for (k, s), r in zip(cfg.sample_batch(4).items(), keys, strict=True)}
    batch["timesteps"] = jnp.arange(4.0) * 100
    noise = jax.random.normal(jax.random.key(2), batch["latents"].shape)
    graph, params = nnx.split(model, nnx.Param)
    blocked = nnx.split(_abstract(UNetConfig.tiny(attention_block=4)), nnx.Param)[0]  # 16 positions, 4 blocks
    forward = jax.jit(lambda g, p: nnx.merge(g, p)(batch), static_argnums=0)
    assert jnp.allclose(forward(blocked, params), forward(graph, params), atol=1e-5)
    tx = optax.adam(1e-3)

    @jax.jit
    def step(p, opt):
        def loss(p):
            pred = nnx.merge(graph, p)(batch)
            assert pred.shape == batch["latents"].shape
            return jnp.mean((pred - noise) ** 2)

        value, grads = jax.value_and_grad(loss)(p)
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, value, finite

    losses, opt = [], jax.jit(tx.init)(params)
    for _ in range(3):
        params, opt, value, finite = step(params, opt)
        assert bool(finite)
        losses.append(float(value))
    assert np.isfinite(losses[0]) and losses[-1] < losses[0]


def test_timestep_embedding_is_cosines_then_sines():
    e = timestep_embedding(jnp.array([0.0, 3.0]), 8)
    assert e.shape == (2, 8)
    assert jnp.allclose(e[0], jnp.array([1.0] * 4 + [0.0] * 4))
    assert float(e[1, 0]) == pytest.approx(float(jnp.cos(3.0)))


@pytest.mark.slow  # 33 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(180)
def test_planned_from_abstract_shapes():
    """The sdxl-unet preset at SDXL's widths and 128 x 128 latents, one transformer block and one residual block per
    level (the full depth plans the same way in ~100 s on 2 CPU cores: stage=2 x data=4, 29.7 GiB, 44% MFU), on 8
    H100 with a batch of 256: the traced FLOPs are the closed form's, and the plan fits (position = latent pixel)."""
    m = model_preset("sdxl-unet", transformer_depth=(0, 1, 1), res_blocks=1)
    p = predict(m.init, optax.adamw(1e-4), m.sample_batch(256), "8xH100", pipeline=False)
    assert p.model_flops_per_token == pytest.approx(m.flops_per_token, rel=1e-9)
    assert p.fits and p.tokens_per_step == 256 * 128**2 and 0 < p.mfu < 1
