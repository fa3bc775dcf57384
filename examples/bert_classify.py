"""A BERT-style encoder (Flax nnx) with a [CLS] classification head, sharded over 8 simulated CPU devices.

Task: does the (variable-length, padded) sequence contain the marker token? Bidirectional attention with a
padding mask, learned positions, post-norm blocks, a tanh pooler on [CLS], cross-entropy on the label.

    python examples/bert_classify.py --steps 150

Example:
    >>> losses = train(steps=3, batch=16, d_model=16, progress=False)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

PAD, CLS, MARKER = 0, 1, 2


def make_data(n: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """``n`` sequences ``[CLS] tokens... [PAD]...``; label 1 when ``MARKER`` occurs (half the sequences)."""
    import numpy as np

    rs = np.random.default_rng(seed)
    lengths = rs.integers(seq_len // 2, seq_len, n)
    tokens = rs.integers(MARKER + 1, vocab, (n, seq_len))
    label = rs.integers(0, 2, n)
    where = (rs.random(n) * (lengths - 1)).astype(int) + 1
    tokens[label == 1, where[label == 1]] = MARKER
    tokens[:, 0] = CLS
    tokens[np.arange(seq_len)[None, :] >= lengths[:, None]] = PAD
    return {"tokens": tokens.astype(np.int32), "label": label.astype(np.int32)}


def build_model(vocab: int, seq_len: int, d_model: int, heads: int, layers: int, seed_key: Any) -> Any:
    """The encoder classifier as an nnx Module."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class EncoderBlock(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
            self.proj = nnx.Linear(d_model, d_model, rngs=rngs)
            self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
            self.fc = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
            self.out = nnx.Linear(4 * d_model, d_model, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)

        def __call__(self, x: jax.Array, keep: jax.Array) -> jax.Array:
            b, s, d = x.shape
            q, k, v = (t.reshape(b, s, heads, d // heads) for t in jnp.split(self.qkv(x), 3, axis=-1))
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
            att = jax.nn.softmax(jnp.where(keep[:, None, None, :], att, -1e9), axis=-1)
            x = self.ln1(x + self.proj(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)))
            return self.ln2(x + self.out(jax.nn.gelu(self.fc(x))))

    class Classifier(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.tok = nnx.Embed(vocab, d_model, rngs=rngs)
            self.pos = nnx.Embed(seq_len, d_model, rngs=rngs)
            self.ln = nnx.LayerNorm(d_model, rngs=rngs)
            self.blocks = nnx.List([EncoderBlock(rngs) for _ in range(layers)])
            self.pool = nnx.Linear(d_model, d_model, rngs=rngs)
            self.head = nnx.Linear(d_model, 2, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            keep = tokens != PAD
            x = self.ln(self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None])
            for block in self.blocks:
                x = block(x, keep)
            return self.head(jnp.tanh(self.pool(x[:, 0])))

    return Classifier(nnx.Rngs(seed_key))


def train(
    steps: int = 150,
    batch: int = 32,
    seq_len: int = 16,
    vocab: int = 32,
    d_model: int = 32,
    heads: int = 4,
    layers: int = 2,
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
        lambda r: build_model(vocab, seq_len, d_model, heads, layers, r),
        optax.adamw(3e-3, weight_decay=0.01),
        mesh,
        plan=plan,
        seed=seed,
    )

    def loss_sum_fn(params: Any, mb: dict[str, jax.Array], rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        logits = state.apply_fn(params, mb["tokens"], model_state=state.model_state)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, mb["label"])
        w = mb["mask"].astype(nll.dtype) if "mask" in mb else jnp.ones_like(nll)
        return jnp.sum(nll * w), jnp.sum(w)

    step = spmd(make_train_step(loss_sum_fn), mesh=mesh, plan=the_plan)
    data = ArrayDataset(make_data(max(16 * batch, 1024), seq_len, vocab, seed), batch, seed=seed)
    result = Trainer(step, progress=progress).fit(state, data, num_steps=steps)
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
