"""A Llama-family decoder (Flax nnx): RMSNorm, rotary positions, grouped KV heads, SwiGLU MLP, no biases.

Presets (`LlamaConfig.llama2_7b`, ..., `LlamaConfig.llama3_405b`) carry the published shapes, for planning at
scale with ``jax.eval_shape``; `LlamaConfig.tiny` is for tests.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
    >>> LlamaConfig.llama3_8b().num_params()
    8030261248
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from openhosti_jax.errors import ConfigError, StateError
from openhosti_jax.models.attention import KERNELS, causal_attention
from openhosti_jax.models.checks import dtype_problem, finite_number, positive_ints
from openhosti_jax.models.context import STRATEGIES
from openhosti_jax.policies.remat import keep
from openhosti_jax.sharding.rules import LAYER_AXIS
from openhosti_jax.state.blocks import stack_modules

_POSITIVE_INTS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_kv_heads", "ffn", "n_layers")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model."""

    vocab_size: int
    """Vocabulary size (embedding rows and logits)."""
    seq_len: int
    """Maximum sequence length (positions are rotary: nothing is allocated per position)."""
    d_model: int
    """Residual width."""
    n_heads: int
    """Query heads; must divide ``d_model``, and the head width ``d_model // n_heads`` must be even (RoPE pairs)."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn: int
    """SwiGLU hidden width."""
    n_layers: int
    """Transformer blocks."""
    rope_theta: float = 10000.0
    """RoPE base: frequencies ``rope_theta ** (-2i / head_dim)`` (no long-context frequency scaling)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Use the token embedding as the output head."""
    dtype: str = "float32"
    """Compute dtype (parameters stay float32, logits are float32)."""
    scan_layers: bool = False
    """Stack the blocks' parameters over a leading ``"layers"`` axis and run them with ``nnx.scan``."""
    attention_block: int | None = None
    """Queries per attention block (`openhosti_jax.models.attention.query_blocks`); None: all at once."""
    context_strategy: str = "ring"
    """Under a mesh with a ``context`` axis larger than 1, how attention brings each sequence piece the others' keys
    and values: ``"ring"`` or ``"all_gather"`` (`openhosti_jax.models.context`)."""
    attention_kernel: str = "auto"
    """The attention kernel (`openhosti_jax.models.attention.KERNELS`): ``"auto"`` runs cuDNN's fused attention on a
    GPU in bf16/fp16 and XLA's elsewhere; ``"cudnn"`` on a backend without it is a `ConfigError` when traced."""

    def __post_init__(self) -> None:
        bad, problems = positive_ints({k: getattr(self, k) for k in _POSITIVE_INTS}, _POSITIVE_INTS)
        if not bad & {"d_model", "n_heads"}:
            if self.d_model % self.n_heads:
                problems.append(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
            elif (self.d_model // self.n_heads) % 2:
                problems.append(
                    f"n_heads={self.n_heads} gives an odd head width d_model // n_heads = "
                    f"{self.d_model // self.n_heads}; RoPE needs an even one"
                )
        if not bad & {"n_heads", "n_kv_heads"} and self.n_heads % self.n_kv_heads:
            problems.append(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        problems += [
            p for k in ("rope_theta", "norm_eps") if (p := finite_number(k, getattr(self, k), minimum=0, strict=True))
        ]
        for k in ("tie_embeddings", "scan_layers"):
            if not isinstance(getattr(self, k), bool):
                problems.append(f"{k}={getattr(self, k)!r} must be a bool")
        problems += [p for p in [dtype_problem(self.dtype)] if p]
        if self.context_strategy not in STRATEGIES:
            problems.append(f"context_strategy={self.context_strategy!r} must be one of {STRATEGIES}")
        if self.attention_kernel not in KERNELS:
            problems.append(f"attention_kernel={self.attention_kernel!r} must be one of {KERNELS}")
        if problems:
            raise ConfigError("invalid LlamaConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @classmethod
    def tiny(cls, **kw: Any) -> LlamaConfig:
        """A model small enough for unit tests (~0.2M parameters, 2 query heads per KV head)."""
        return cls(
            **{
                "vocab_size": 256,
                "seq_len": 32,
                "d_model": 64,
                "n_heads": 4,
                "n_kv_heads": 2,
                "ffn": 128,
                "n_layers": 2,
                **kw,
            }
        )

    @classmethod
    def llama2_7b(cls, **kw: Any) -> LlamaConfig:
        """Llama-2 7B (6.74B parameters)."""
        return cls(**{**_LLAMA2, "d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "ffn": 11008, "n_layers": 32, **kw})

    @classmethod
    def llama2_70b(cls, **kw: Any) -> LlamaConfig:
        """Llama-2 70B (69.0B parameters)."""
        return cls(**{**_LLAMA2, "d_model": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn": 28672, "n_layers": 80, **kw})

    @classmethod
    def llama3_8b(cls, **kw: Any) -> LlamaConfig:
        """Llama-3.1 8B (8.03B parameters)."""
        return cls(**{**_LLAMA3, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn": 14336, "n_layers": 32, **kw})

    @classmethod
    def llama3_70b(cls, **kw: Any) -> LlamaConfig:
        """Llama-3.1 70B (70.6B parameters)."""
        return cls(**{**_LLAMA3, "d_model": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn": 28672, "n_layers": 80, **kw})

    @classmethod
    def llama3_405b(cls, **kw: Any) -> LlamaConfig:
        """Llama-3.1 405B (405.9B parameters)."""
        return cls(
            **{**_LLAMA3, "d_model": 16384, "n_heads": 128, "n_kv_heads": 8, "ffn": 53248, "n_layers": 126, **kw}
        )

    def _matmul_params_per_layer(self) -> int:
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        return 2 * d * d + 2 * d * kv + 3 * d * self.ffn  # q, o; k, v; gate, up, down

    def num_params(self) -> int:
        """Exact parameter count (embeddings included; the head once more unless tied), from the shapes alone."""
        d, v = self.d_model, self.vocab_size
        per_layer = self._matmul_params_per_layer() + 2 * d  # + two RMSNorm weights
        return v * d + self.n_layers * per_layer + d + (0 if self.tie_embeddings else d * v)

    def flops_per_token(self) -> int:
        """Training FLOPs per token at ``seq_len``: 3 x the forward's matmuls (backward = 2 x forward).

        ``6 * (n_layers * matmul params per layer + d_model * vocab_size) + 12 * n_layers * d_model * seq_len``: a
        matmul with P weights costs 2P FLOPs per token; the head is a matmul, tied or not, the embedding lookup is
        not; attention scores ``q.k`` and the weighted sum of values cost ``2 * seq_len * d_model`` each per token
        and layer, counted over the full ``seq_len x seq_len`` square (as in `GPTConfig.flops_per_token`: no
        causal halving). Norms, RoPE, softmax and SiLU are not counted.
        """
        d, s = self.d_model, self.seq_len
        return 6 * (self.n_layers * self._matmul_params_per_layer() + d * self.vocab_size) + 12 * self.n_layers * d * s


_LLAMA2: dict[str, Any] = {"vocab_size": 32000, "seq_len": 4096, "rope_theta": 10000.0, "norm_eps": 1e-5}
_LLAMA3: dict[str, Any] = {"vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0, "norm_eps": 1e-5}
"""Llama-3.1 was pretrained at 8192 tokens, then extended to 128K with scaled RoPE frequencies (not modelled here:
pass ``seq_len=131072`` to plan for the long context; the shapes and FLOPs are right, the frequencies are not)."""

_INIT = nnx.initializers.normal(0.02)


def _named(*names: str | None) -> dict[str, Any]:
    """Variable metadata naming each dim logically (`openhosti_jax.sharding.rules`: ``"heads"``, ``"mlp"``,
    ``"vocab"`` split over ``tensor``; a stacked block's ``nnx.vmap`` prepends ``"layers"``), applied by the
    plan, not at init."""
    return {"out_sharding": names, "eager_sharding": False}


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last axis, statistics in float32."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32), **_named("norm"))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * self.weight[...].astype(self.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each ``(seq_len, head_dim // 2)`` float32: angle ``p * theta ** (-2i / head_dim)`` of position
    ``p`` and frequency ``i``."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``(batch, seq, heads, head_dim)``: feature ``i`` of the first half pairs with feature ``i`` of
    the second half (the Hugging Face layout), rotated by the angle of ``(cos, sin)`` ``(seq, head_dim // 2)``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Block(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + down(silu(gate(h)) * up(h))`` with ``h = norm(x)``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
        kv = cfg.n_kv_heads * cfg.head_dim

        def dense(n_in: int, n_out: int, *names: str) -> nnx.Linear:
            return nnx.Linear(
                n_in, n_out, use_bias=False, dtype=dt, kernel_init=_INIT, kernel_metadata=_named(*names), rngs=rngs
            )

        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.norm_eps, dt)
        self.wq = dense(d, d, "embed", "heads")  # column-parallel: heads over tensor
        self.wk = dense(d, kv, "embed", "kv_heads")
        self.wv = dense(d, kv, "embed", "kv_heads")
        self.wo = dense(d, d, "heads", "embed")  # row-parallel: one all-reduce per attention
        self.mlp_norm = RMSNorm(d, cfg.norm_eps, dt)
        self.gate = dense(d, cfg.ffn, "embed", "mlp")
        self.up = dense(d, cfg.ffn, "embed", "mlp")
        self.down = dense(cfg.ffn, d, "mlp", "embed")

    def attention(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Causal grouped-query self-attention of normed ``x`` ``(batch, seq, d_model)``."""
        b, s, d = x.shape
        kvh, hd = self.cfg.n_kv_heads, self.cfg.head_dim
        group = self.cfg.n_heads // kvh
        q = apply_rope(keep(self.wq(x)).reshape(b, s, kvh * group, hd), cos, sin)  # kept: every other projection
        k = apply_rope(self.wk(x).reshape(b, s, kvh, hd), cos, sin)
        v = keep(self.wv(x)).reshape(b, s, kvh, hd)
        cfg = self.cfg  # query head h reads kv head h // group
        y = causal_attention(
            q, k, v, block=cfg.attention_block, context_strategy=cfg.context_strategy, kernel=cfg.attention_kernel
        )
        y = keep(y.reshape(b, s, d))
        return self.wo(y)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attention(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + keep(self.down(jax.nn.silu(keep(self.gate(h))) * self.up(h)))


def stacked_blocks(cfg: LlamaConfig, rngs: nnx.Rngs) -> Block:
    """One `Block` whose parameters are stacked over a leading ``"layers"`` axis of size ``cfg.n_layers``."""
    return stack_modules(lambda r: Block(cfg, rngs=r), cfg.n_layers, rngs)


@nnx.scan(in_axes=(nnx.Carry, 0, None, None), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
def _scan_blocks(x: jax.Array, block: Block, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return block(x, cos, sin)


class Llama(nnx.Module):
    """Token embedding, ``n_layers`` blocks (a list, or one stacked block with ``scan_layers``), final RMSNorm,
    output head (the embedding when ``tie_embeddings``). Weights are initialised ``normal(0.02)``, norms to one."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=dt,
            embedding_init=_INIT,
            embedding_metadata=_named("vocab", "embed"),
            rngs=rngs,
        )
        if cfg.scan_layers:
            self.blocks: Block | nnx.List = stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, dt)
        self.head = (
            None
            if cfg.tie_embeddings
            else nnx.Linear(
                cfg.d_model,
                cfg.vocab_size,
                use_bias=False,
                dtype=dt,
                kernel_init=_INIT,
                kernel_metadata=_named("embed", "vocab"),
                rngs=rngs,
            )
        )

    def __call__(self, tokens: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """float32 logits ``(batch, seq, vocab_size)`` of int ``tokens`` ``(batch, seq)``, ``seq <= seq_len``.

        ``rng`` is accepted for the `GPT` calling convention and unused (Llama has no dropout).
        """
        del rng
        s = tokens.shape[1]
        if s > self.cfg.seq_len:
            raise StateError(f"expected at most seq_len={self.cfg.seq_len} tokens per sequence, found {s}")
        cos, sin = rope_tables(s, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed(tokens)
        if self.cfg.scan_layers:
            x = _scan_blocks(x, self.blocks, cos, sin)
        else:
            for block in self.blocks:
                x = block(x, cos, sin)
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return logits.astype(jnp.float32)
