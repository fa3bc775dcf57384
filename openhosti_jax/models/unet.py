"""A latent-diffusion UNet of Stable Diffusion XL's layout (Podell et al. 2023), for planning image models at scale.

Residual blocks conditioned on the timestep (and SDXL's pooled-text and size vector), spatial transformers with
self-attention, cross-attention to the text context and a GEGLU feed-forward, three levels down and up with skip
concatenations. `UNetConfig.sdxl` has SDXL's widths and depths (2.57B parameters); `UNetConfig.num_params` counts
them in closed form, independently of the modules.

Example:
    >>> import jax
    >>> from flax import nnx
    >>> cfg = UNetConfig.tiny()
    >>> model = nnx.eval_shape(lambda: UNet(cfg, rngs=nnx.Rngs(0)))  # shapes only: nothing allocated
    >>> nnx.eval_shape(lambda m, b: m(b), model, cfg.sample_batch(2)).shape  # predicted noise, as the latents
    (2, 8, 8, 4)
    >>> sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == cfg.num_params()
    True
    >>> f"{UNetConfig.sdxl().num_params():,}", f"{UNetConfig.sdxl().flops_per_example() / 1e12:.1f} TFLOPs"
    ('2,567,463,684', '20.3 TFLOPs')
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx

from openhosti_jax.errors import ConfigError
from openhosti_jax.models.attention import query_blocks


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """Shape of the UNet."""

    latent_size: int = 128
    """Height and width of the latent image (SDXL: 1024 pixels / 8)."""
    channels_in: int = 4
    """Latent channels in and out."""
    channels: tuple[int, ...] = (320, 640, 1280)
    """Width of each level, top to bottom."""
    res_blocks: int = 2
    """Residual blocks per level on the way down (one more on the way up)."""
    transformer_depth: tuple[int, ...] = (0, 2, 10)
    """Transformer blocks after each residual block of a level (0: none)."""
    head_dim: int = 64
    """Width of an attention head."""
    context_dim: int = 2048
    """Width of the text encoder's tokens."""
    context_len: int = 77
    """Text tokens."""
    adm_dim: int = 2816
    """Width of SDXL's extra conditioning vector (pooled text and image sizes); 0: none."""
    groups: int = 32
    """Group-norm groups."""
    dtype: str = "float32"
    """Compute dtype (parameters stay float32)."""
    attention_block: int | None = None
    """Queries per attention block (at most: the largest divisor of the positions that it divides is used): scores
    made a block at a time and recomputed in the backward, as flash attention's; None: the whole square at once."""

    def __post_init__(self) -> None:
        if len(self.channels) != len(self.transformer_depth) or any(c % self.groups for c in self.channels):
            raise ConfigError(
                f"channels {self.channels} need one transformer depth each (found {self.transformer_depth}) and to "
                f"be multiples of groups={self.groups}"
            )
        if any(c % self.head_dim for c, d in zip(self.channels, self.transformer_depth, strict=True) if d):
            raise ConfigError(f"head_dim={self.head_dim} must divide the width of every level with transformers")
        if self.latent_size % 2 ** (len(self.channels) - 1):
            raise ConfigError(f"latent_size={self.latent_size} must halve {len(self.channels) - 1} times")

    @classmethod
    def sdxl(cls, **kw: Any) -> UNetConfig:
        """Stable Diffusion XL's UNet at 1024 x 1024 pixels (128 x 128 latents)."""
        return cls(**kw)

    @classmethod
    def tiny(cls, **kw: Any) -> UNetConfig:
        """A UNet small enough for unit tests."""
        small = {"latent_size": 8, "channels": (32, 64), "transformer_depth": (0, 1), "head_dim": 16}
        return cls(**{**small, "context_dim": 24, "context_len": 5, "adm_dim": 12, "groups": 8, **kw})

    @property
    def time_dim(self) -> int:
        """Width of the timestep embedding (4 x the first level's)."""
        return 4 * self.channels[0]

    def sample_batch(self, batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """An abstract global batch of ``batch`` examples: noisy latents, timesteps, text context, extra vector."""
        n, c = self.latent_size, self.channels_in
        out = {
            "latents": jax.ShapeDtypeStruct((batch, n, n, c), jnp.float32),
            "timesteps": jax.ShapeDtypeStruct((batch,), jnp.float32),
            "context": jax.ShapeDtypeStruct((batch, self.context_len, self.context_dim), jnp.float32),
        }
        if self.adm_dim:
            out["y"] = jax.ShapeDtypeStruct((batch, self.adm_dim), jnp.float32)
        return out

    def num_params(self) -> int:
        """Exact parameter count, from the layout alone."""

        def linear(i: int, o: int, bias: bool = True) -> int:
            return i * o + (o if bias else 0)

        def conv(i: int, o: int, k: int = 3) -> int:
            return k * k * i * o + o

        def res(i: int, o: int) -> int:
            return 2 * i + conv(i, o) + linear(self.time_dim, o) + 2 * o + conv(o, o) + (conv(i, o, 1) if i != o else 0)

        def transformer(c: int, depth: int) -> int:
            attn_self = 3 * linear(c, c, False) + linear(c, c)
            attn_cross = linear(c, c, False) + 2 * linear(self.context_dim, c, False) + linear(c, c)
            block = 3 * 2 * c + attn_self + attn_cross + linear(c, 8 * c) + linear(4 * c, c)
            return 2 * c + 2 * linear(c, c) + depth * block

        t, ch = self.time_dim, self.channels
        total = linear(ch[0], t) + linear(t, t) + conv(self.channels_in, ch[0])
        total += linear(self.adm_dim, t) + linear(t, t) if self.adm_dim else 0
        skips, width = [ch[0]], ch[0]
        for level, (c, depth) in enumerate(zip(ch, self.transformer_depth, strict=True)):
            for _ in range(self.res_blocks):
                total += res(width, c) + (transformer(c, depth) if depth else 0)
                width = c
                skips.append(c)
            if level < len(ch) - 1:
                total += conv(c, c)
                skips.append(c)
        total += 2 * res(width, width) + (
            transformer(width, self.transformer_depth[-1]) if self.transformer_depth[-1] else 0
        )
        for level in reversed(range(len(ch))):
            c, depth = ch[level], self.transformer_depth[level]
            for _ in range(self.res_blocks + 1):
                total += res(width + skips.pop(), c) + (transformer(c, depth) if depth else 0)
                width = c
            if level > 0:
                total += conv(c, c)
        return total + 2 * width + conv(width, self.channels_in)

    def flops_per_example(self) -> float:
        """Training FLOPs per example: 3 x the forward's matmuls and convolutions (backward = 2 x forward), from the
        layout alone.

        A matmul or convolution costs 2 x output elements x contracted size: a 3 x 3 convolution from ``i`` to
        ``o`` channels over ``n`` positions ``18 n i o``; a transformer block over ``n`` positions of width ``c``
        with ``m`` context tokens of width ``e`` ``2 n c^2 (4 + 2 + 12)`` (self-attention, cross-attention's query
        and output, the GEGLU feed-forward) ``+ 4 m e c`` (cross keys and values) ``+ 4 n c (n + m)`` (scores and
        weighted values over the full square). Norms, softmax, SiLU and GELU are not counted.
        """
        t, ch, e, m = self.time_dim, self.channels, self.context_dim, self.context_len

        def conv(n: int, i: int, o: int, k: int = 3) -> int:
            return 2 * n * k * k * i * o

        def res(n: int, i: int, o: int) -> int:
            return conv(n, i, o) + 2 * t * o + conv(n, o, o) + (conv(n, i, o, 1) if i != o else 0)

        def transformer(n: int, c: int, depth: int) -> int:
            block = 2 * n * c * c * 18 + 4 * m * e * c + 4 * n * c * (n + m)
            return (4 * n * c * c + depth * block) if depth else 0

        n = self.latent_size**2
        total = 2 * (ch[0] * t + t * t) + (2 * (self.adm_dim * t + t * t) if self.adm_dim else 0)
        total += conv(n, self.channels_in, ch[0]) + conv(n, ch[0], self.channels_in)
        skips, width = [ch[0]], ch[0]
        for level, (c, depth) in enumerate(zip(ch, self.transformer_depth, strict=True)):
            for _ in range(self.res_blocks):
                total += res(n, width, c) + transformer(n, c, depth)
                width = c
                skips.append(c)
            if level < len(ch) - 1:
                n //= 4
                total += conv(n, c, c)
                skips.append(c)
        total += 2 * res(n, width, width) + transformer(n, width, self.transformer_depth[-1])
        for level in reversed(range(len(ch))):
            c, depth = ch[level], self.transformer_depth[level]
            for _ in range(self.res_blocks + 1):
                total += res(n, width + skips.pop(), c) + transformer(n, c, depth)
                width = c
            if level > 0:
                n *= 4
                total += conv(n, c, c)
        return 3.0 * total

    def flops_per_token(self) -> float:
        """Training FLOPs per latent position (a UNet's "token" is a pixel of the latent: `flops_per_example` over
        ``latent_size ** 2``), as the planner's tokens per example count them."""
        return self.flops_per_example() / self.latent_size**2


class _ResBlock(nnx.Module):
    def __init__(self, cfg: UNetConfig, cin: int, cout: int, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.norm1 = nnx.GroupNorm(cin, cfg.groups, rngs=rngs, dtype=dt)
        self.conv1 = nnx.Conv(cin, cout, (3, 3), rngs=rngs, dtype=dt)
        self.emb = nnx.Linear(cfg.time_dim, cout, rngs=rngs, dtype=dt)
        self.norm2 = nnx.GroupNorm(cout, cfg.groups, rngs=rngs, dtype=dt)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), rngs=rngs, dtype=dt)
        self.skip = nnx.Conv(cin, cout, (1, 1), rngs=rngs, dtype=dt) if cin != cout else None

    def __call__(self, x: jax.Array, emb: jax.Array) -> jax.Array:
        h = self.conv1(jax.nn.silu(self.norm1(x))) + self.emb(jax.nn.silu(emb))[:, None, None]
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        return h + (x if self.skip is None else self.skip(x))


class _Attention(nnx.Module):
    def __init__(self, cfg: UNetConfig, c: int, source: int, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.heads, self.block = c // cfg.head_dim, cfg.attention_block
        self.q = nnx.Linear(c, c, use_bias=False, rngs=rngs, dtype=dt)
        self.k = nnx.Linear(source, c, use_bias=False, rngs=rngs, dtype=dt)
        self.v = nnx.Linear(source, c, use_bias=False, rngs=rngs, dtype=dt)
        self.out = nnx.Linear(c, c, rngs=rngs, dtype=dt)

    def __call__(self, x: jax.Array, source: jax.Array) -> jax.Array:
        b, n, c = x.shape
        q, k, v = (t.reshape(b, -1, self.heads, c // self.heads) for t in (self.q(x), self.k(source), self.v(source)))

        def attend(qb: jax.Array, first: jax.Array) -> jax.Array:
            att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", qb, k) / math.sqrt(c // self.heads), axis=-1)
            return jnp.einsum("bhqk,bkhd->bqhd", att, v)

        block = math.gcd(self.block, n) if self.block else None
        return self.out(query_blocks(attend, q, block).reshape(b, n, c))


class _TransformerBlock(nnx.Module):
    def __init__(self, cfg: UNetConfig, c: int, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.norm1, self.norm2, self.norm3 = (nnx.LayerNorm(c, rngs=rngs, dtype=dt) for _ in range(3))
        self.attn1 = _Attention(cfg, c, c, rngs)
        self.attn2 = _Attention(cfg, c, cfg.context_dim, rngs)
        self.geglu = nnx.Linear(c, 8 * c, rngs=rngs, dtype=dt)
        self.ff_out = nnx.Linear(4 * c, c, rngs=rngs, dtype=dt)

    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        h = self.norm1(x)
        x = x + self.attn1(h, h)
        x = x + self.attn2(self.norm2(x), context)
        value, gate = jnp.split(self.geglu(self.norm3(x)), 2, axis=-1)
        return x + self.ff_out(value * jax.nn.gelu(gate))


class _SpatialTransformer(nnx.Module):
    def __init__(self, cfg: UNetConfig, c: int, depth: int, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.norm = nnx.GroupNorm(c, cfg.groups, rngs=rngs, dtype=dt)
        self.proj_in = nnx.Linear(c, c, rngs=rngs, dtype=dt)
        self.blocks = nnx.List([_TransformerBlock(cfg, c, rngs) for _ in range(depth)])
        self.proj_out = nnx.Linear(c, c, rngs=rngs, dtype=dt)

    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        b, hh, ww, c = x.shape
        h = self.proj_in(self.norm(x).reshape(b, hh * ww, c))
        for block in self.blocks:
            h = block(h, context)
        return x + self.proj_out(h).reshape(b, hh, ww, c)


class _Stage(nnx.Module):
    """A residual block and, where the level has them, its spatial transformer."""

    def __init__(self, cfg: UNetConfig, cin: int, cout: int, depth: int, rngs: nnx.Rngs):
        self.res = _ResBlock(cfg, cin, cout, rngs)
        self.attn = _SpatialTransformer(cfg, cout, depth, rngs) if depth else None

    def __call__(self, x: jax.Array, emb: jax.Array, context: jax.Array) -> jax.Array:
        x = self.res(x, emb)
        return x if self.attn is None else self.attn(x, context)


def timestep_embedding(t: jax.Array, dim: int, max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding ``(batch, dim)`` of timesteps ``(batch,)``: cosines then sines of geometric frequencies."""
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(dim // 2, dtype=jnp.float32) / (dim // 2))
    angles = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


class _Keys:
    """The ``rngs.params()`` the nnx layers call, each a fold of one key with a Python counter. `nnx.Rngs` keeps its
    counter in a variable, and under a trace (`nnx.eval_shape`) each update of it costs time linear in the trace so
    far (flax 0.12 asks the traced counter for its ``sharding``, and JAX's error message walks the whole trace):
    SDXL's 1,680 parameters took 65 s to build abstractly with `nnx.Rngs`, 3 s with these."""

    def __init__(self, key: jax.Array):
        self.key, self.count = key, 0

    def params(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


class UNet(nnx.Module):
    """``model(batch)`` with ``batch`` as `UNetConfig.sample_batch` lays it out -> the predicted noise, shaped as
    ``batch["latents"]``."""

    def __init__(self, cfg: UNetConfig, *, rngs: nnx.Rngs):
        dt, ch, t = jnp.dtype(cfg.dtype), cfg.channels, cfg.time_dim
        self.cfg = cfg
        rngs = cast(nnx.Rngs, _Keys(rngs.params()))
        self.time_in, self.time_out = nnx.Linear(ch[0], t, rngs=rngs, dtype=dt), nnx.Linear(t, t, rngs=rngs, dtype=dt)
        self.adm_in = nnx.Linear(cfg.adm_dim, t, rngs=rngs, dtype=dt) if cfg.adm_dim else None
        self.adm_out = nnx.Linear(t, t, rngs=rngs, dtype=dt) if cfg.adm_dim else None
        self.conv_in = nnx.Conv(cfg.channels_in, ch[0], (3, 3), rngs=rngs, dtype=dt)
        down, downsample, skips, width = [], [], [ch[0]], ch[0]
        for level, (c, depth) in enumerate(zip(ch, cfg.transformer_depth, strict=True)):
            for _ in range(cfg.res_blocks):
                down.append(_Stage(cfg, width, c, depth, rngs))
                width = c
                skips.append(c)
            if level < len(ch) - 1:
                downsample.append(nnx.Conv(c, c, (3, 3), strides=2, rngs=rngs, dtype=dt))
                skips.append(c)
        self.down, self.downsample = nnx.List(down), nnx.List(downsample)
        self.mid = _Stage(cfg, width, width, cfg.transformer_depth[-1], rngs)
        self.mid_res = _ResBlock(cfg, width, width, rngs)
        up, upsample = [], []
        for level in reversed(range(len(ch))):
            for _ in range(cfg.res_blocks + 1):
                up.append(_Stage(cfg, width + skips.pop(), ch[level], cfg.transformer_depth[level], rngs))
                width = ch[level]
            if level > 0:
                upsample.append(nnx.Conv(width, width, (3, 3), rngs=rngs, dtype=dt))
        self.up, self.upsample = nnx.List(up), nnx.List(upsample)
        self.norm_out = nnx.GroupNorm(width, cfg.groups, rngs=rngs, dtype=dt)
        self.conv_out = nnx.Conv(width, cfg.channels_in, (3, 3), rngs=rngs, dtype=dt)

    def __call__(self, batch: dict[str, jax.Array]) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        emb = self.time_out(jax.nn.silu(self.time_in(timestep_embedding(batch["timesteps"], cfg.channels[0]))))
        if self.adm_in is not None and self.adm_out is not None:
            emb = emb + self.adm_out(jax.nn.silu(self.adm_in(batch["y"])))
        context = batch["context"].astype(dt)
        x = self.conv_in(batch["latents"].astype(dt))
        skips, i = [x], 0
        for level in range(len(cfg.channels)):
            for _ in range(cfg.res_blocks):
                x = self.down[i](x, emb, context)
                skips.append(x)
                i += 1
            if level < len(cfg.channels) - 1:
                x = self.downsample[level](x)
                skips.append(x)
        x = self.mid_res(self.mid(x, emb, context), emb)
        i = 0
        for j, level in enumerate(reversed(range(len(cfg.channels)))):
            for _ in range(cfg.res_blocks + 1):
                x = self.up[i](jnp.concatenate([x, skips.pop()], axis=-1), emb, context)
                i += 1
            if level > 0:
                x = self.upsample[j](jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))
        return self.conv_out(jax.nn.silu(self.norm_out(x))).astype(jnp.float32)
