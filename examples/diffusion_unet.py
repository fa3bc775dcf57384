"""A small denoising-diffusion UNet (Flax nnx) on 8x8 synthetic images, sharded over 8 simulated CPU devices.

DDPM objective: ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps``, the UNet predicts ``eps`` (mean squared
error). The images are random bars; the noise and timesteps are drawn once per sample by the data pipeline, so
every device count sees identical numbers.

    python examples/diffusion_unet.py --steps 150

Example:
    >>> losses = train(steps=3, batch=16, channels=4, progress=False)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

SIZE, T = 8, 100


def alpha_bar() -> Any:
    """Cumulative signal fraction per timestep (linear beta schedule 1e-4 .. 0.02 over ``T`` steps)."""
    import numpy as np

    return np.cumprod(1.0 - np.linspace(1e-4, 0.02, T)).astype(np.float32)


def make_data(n: int, seed: int = 0) -> dict[str, Any]:
    """``x0`` (one horizontal or vertical bar per 8x8 image, in [-1, 1]), ``eps`` noise and timestep ``t``."""
    import numpy as np

    rs = np.random.default_rng(seed)
    x0 = -np.ones((n, SIZE, SIZE, 1), np.float32)
    pos = rs.integers(0, SIZE, n)
    vertical = rs.random(n) < 0.5
    x0[vertical, :, pos[vertical]] = 1.0
    x0[~vertical, pos[~vertical], :] = 1.0
    eps = rs.normal(size=x0.shape).astype(np.float32)
    return {"x0": x0, "eps": eps, "t": rs.integers(0, T, n).astype(np.int32)}


def build_model(channels: int, seed_key: Any) -> Any:
    """UNet: 8x8 -> 4x4 -> 8x8 with a skip connection and a sinusoidal timestep embedding."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    c = channels

    class UNet(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.temb = nnx.Linear(16, 2 * c, rngs=rngs)
            self.inc = nnx.Conv(1, c, (3, 3), rngs=rngs)
            self.down = nnx.Conv(c, 2 * c, (3, 3), strides=(2, 2), rngs=rngs)
            self.mid = nnx.Conv(2 * c, 2 * c, (3, 3), rngs=rngs)
            self.up = nnx.Conv(3 * c, c, (3, 3), rngs=rngs)
            self.outc = nnx.Conv(c, 1, (3, 3), rngs=rngs)
            self.norm = nnx.GroupNorm(2 * c, num_groups=2, rngs=rngs)

        def __call__(self, x: jax.Array, t: jax.Array) -> jax.Array:
            freqs = jnp.exp(-jnp.log(1000.0) * jnp.arange(8) / 8)
            angles = t.astype(jnp.float32)[:, None] * freqs[None]
            emb = self.temb(jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1))
            h1 = jax.nn.silu(self.inc(x))
            h2 = jax.nn.silu(self.down(h1)) + emb[:, None, None, :]
            h2 = jax.nn.silu(self.norm(self.mid(h2))) + h2
            up = jnp.repeat(jnp.repeat(h2, 2, axis=1), 2, axis=2)
            h = jax.nn.silu(self.up(jnp.concatenate([up, h1], axis=-1)))
            return self.outc(h)

    return UNet(nnx.Rngs(seed_key))


def train(
    steps: int = 150,
    batch: int = 32,
    channels: int = 16,
    devices: Sequence[Any] | None = None,
    plan: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """Train on ``devices`` (default all) with ``plan`` (default ``"auto"``); return the per-step losses."""
    import jax
    import jax.numpy as jnp
    import optax

    from openhosti_jax import MeshConfig, Trainer, build_mesh, create_train_state, spmd
    from openhosti_jax.data import ArrayDataset
    from openhosti_jax.microbatch import make_train_step

    mesh = build_mesh(MeshConfig(data=1, fsdp=-1), devices or jax.devices())
    state, the_plan = create_train_state(
        lambda r: build_model(channels, r), optax.adam(2e-3), mesh, plan=plan, seed=seed
    )
    abar = jnp.asarray(alpha_bar())

    def loss_sum_fn(params: Any, mb: dict[str, jax.Array], rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        a = abar[mb["t"]][:, None, None, None]
        x_t = jnp.sqrt(a) * mb["x0"] + jnp.sqrt(1.0 - a) * mb["eps"]
        pred = state.apply_fn(params, x_t, mb["t"], model_state=state.model_state)
        per_sample = jnp.mean((pred - mb["eps"]) ** 2, axis=(1, 2, 3))
        w = mb["mask"].astype(per_sample.dtype) if "mask" in mb else jnp.ones_like(per_sample)
        return jnp.sum(per_sample * w), jnp.sum(w)

    step = spmd(make_train_step(loss_sum_fn), mesh=mesh, plan=the_plan)
    data = ArrayDataset(make_data(max(16 * batch, 1024), seed), batch, seed=seed)
    result = Trainer(step, progress=progress, tokens_in_batch=lambda b: len(b["t"])).fit(state, data, steps)
    return [h["loss"] for h in result.history]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--plan", default="auto", help="sharding plan: auto (default), fsdp, dp, zero1, zero2")
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    losses = train(steps=args.steps, batch=args.batch, plan=args.plan)
    print(f"plan {args.plan}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
