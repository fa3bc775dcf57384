"""Train a Flax **linen** MLP classifier (three interleaved spirals) sharded over 8 simulated CPU devices.

Shows that a linen model works unchanged: ``init_fn`` returns the params, ``apply_fn=model.apply``.

    python examples/linen_mlp.py --steps 200

Example:
    >>> losses = train(steps=3, batch=16, width=16, progress=False)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


def make_spirals(n: int, classes: int = 3, seed: int = 0) -> dict[str, Any]:
    """``n`` 2-D points on ``classes`` noisy interleaved spiral arms; ``{"x": [n, 2] f32, "y": [n] int32}``."""
    import numpy as np

    rs = np.random.default_rng(seed)
    y = rs.integers(0, classes, n)
    r = rs.uniform(0.1, 1.0, n)
    theta = 2 * np.pi * y / classes + 3.0 * r + rs.normal(0, 0.15, n)
    x = np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1).astype(np.float32)
    return {"x": x, "y": y.astype(np.int32)}


def train(
    steps: int = 200,
    batch: int = 64,
    width: int = 64,
    depth: int = 3,
    devices: Sequence[Any] | None = None,
    plan: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """Train on ``devices`` (default all) with ``plan`` (default ``"auto"``); return the per-step losses."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from openhosti_jax import MeshConfig, Trainer, build_mesh, create_train_state, spmd
    from openhosti_jax.data import ArrayDataset
    from openhosti_jax.microbatch import make_train_step

    class MLP(nn.Module):
        width: int
        depth: int
        classes: int = 3

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(self.depth):
                x = nn.gelu(nn.LayerNorm()(nn.Dense(self.width)(x)))
            return nn.Dense(self.classes)(x)

    model = MLP(width, depth)
    mesh = build_mesh(MeshConfig(data=1, fsdp=-1), devices or jax.devices())
    state, the_plan = create_train_state(
        lambda r: model.init(r, jnp.zeros((1, 2)))["params"],
        optax.adam(1e-2),
        mesh,
        plan=plan,
        apply_fn=model.apply,
        seed=seed,
    )

    def loss_sum_fn(params: Any, mb: dict[str, jax.Array], rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        logits = state.apply_fn({"params": params}, mb["x"])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"])
        w = mb["mask"].astype(nll.dtype) if "mask" in mb else jnp.ones_like(nll)
        return jnp.sum(nll * w), jnp.sum(w)

    step = spmd(make_train_step(loss_sum_fn), mesh=mesh, plan=the_plan)
    data = ArrayDataset(make_spirals(max(16 * batch, 1024), seed=seed), batch, seed=seed)
    result = Trainer(step, progress=progress).fit(state, data, num_steps=steps)
    return [h["loss"] for h in result.history]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
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
