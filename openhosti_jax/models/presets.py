"""Published model shapes by name, built from the bundled families for planning at scale (abstractly: the planner
never allocates their parameters): ``gpt3-175b``, ``bert-large`` (the encoder with a classification head, on
fine-tuning batches), ``llama2-7b``, ``llama2-70b``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``, the mixtures of
experts ``mixtral-8x7b`` (46.7B parameters, 12.9B active) and ``deepseek-moe-16b`` (16.4B, 2.8B active; fine-grained
experts and shared ones), ``sdxl-unet`` (Stable Diffusion XL's 2.57B UNet), or a GPT- or Llama-family shape from its
dimensions (`gpt_shape`, `llama_shape`). A preset's ``flops_per_token`` counts the parameters a token runs through (an
MoE layer's ``top_k`` routed experts, not all of them).

Each language model is built with its blocks scanned (one layer's parameters gathered at a time under ZeRO-3), and
every model with attention over blocks of queries (activations linear in the sequence, as flash attention's), as large
runs train them.

Example:
    >>> m = model_preset("llama3-8b", seq_len=4096)
    >>> m.name, m.config.seq_len, f"{m.config.num_params() / 1e9:.2f}B"
    ('llama3-8b', 4096, '8.03B')
    >>> m = model_preset("deepseek-moe-16b")
    >>> f"{m.config.num_params() / 1e9:.1f}B", f"{m.config.active_params() / 1e9:.2f}B", m.flops_per_token / 1e9
    ('16.4B', '2.83B', 17.122197504)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from openhosti_jax.errors import ConfigError
from openhosti_jax.models.bert import Bert, BertConfig
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.models.unet import UNet, UNetConfig

_PRESETS: dict[str, tuple[type, Callable[..., Any]]] = {
    "gpt3-175b": (GPT, GPTConfig.gpt3_175b),
    "bert-large": (Bert, BertConfig.large),
    "llama2-7b": (Llama, LlamaConfig.llama2_7b),
    "llama2-70b": (Llama, LlamaConfig.llama2_70b),
    "llama3-8b": (Llama, LlamaConfig.llama3_8b),
    "llama3-70b": (Llama, LlamaConfig.llama3_70b),
    "llama3-405b": (Llama, LlamaConfig.llama3_405b),
    "mixtral-8x7b": (Llama, LlamaConfig.mixtral_8x7b),
    "deepseek-moe-16b": (Llama, LlamaConfig.deepseek_moe_16b),
    "sdxl-unet": (UNet, UNetConfig.sdxl),
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)
"""The preset names."""

ATTENTION_BLOCK = 512
"""Queries per attention block of the presets (at most; the largest power-of-two part of it that divides the
sequence length)."""


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """A named model shape and how to build it."""

    name: str
    config: Any
    """Its `GPTConfig`, `LlamaConfig`, `BertConfig` or `UNetConfig`."""
    family: type

    def init(self, rngs: Any) -> nnx.Module:
        """The module (an init function as the planner takes, ``init(rng)``)."""
        return self.family(self.config, rngs=nnx.Rngs(rngs))

    @property
    def flops_per_token(self) -> float | None:
        """Training FLOPs per token by the family's formula (what MFU counts; a UNet's token is a latent pixel); None
        where the family has none (the planner then counts the traced matmuls and convolutions)."""
        return self.config.flops_per_token() if hasattr(self.config, "flops_per_token") else None

    @property
    def tokens_per_example(self) -> int:
        """Positions per example: the sequence length, or a UNet's latent pixels."""
        return getattr(self.config, "seq_len", None) or self.config.latent_size**2

    def sample_batch(self, batch: int) -> Any:
        """An abstract global batch of ``batch`` examples: ``(batch, seq_len)`` int32 tokens, or the family's own
        layout where it has one (`BertConfig.sample_batch`: tokens, token types, padding mask and labels;
        `UNetConfig.sample_batch`)."""
        if hasattr(self.config, "sample_batch"):
            return self.config.sample_batch(batch)
        return jax.ShapeDtypeStruct((batch, self.config.seq_len), jnp.int32)


def model_preset(name: str, **overrides: Any) -> ModelPreset:
    """The preset ``name`` (see `PRESETS`), its config fields overridden (``seq_len=``, ``vocab_size=``, ...)."""
    if name not in _PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {PRESETS}, or give the dimensions")
    family, make = _PRESETS[name]
    base = make()
    fields = {f.name for f in dataclasses.fields(base)}
    at_scale = _at_scale(overrides.get("seq_len") or getattr(base, "seq_len", None))
    defaults = {k: v for k, v in at_scale.items() if k in fields}  # a UNet has no scanned layers
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"preset {name!r} has no fields {unknown}; its fields are {sorted(fields)}")
    return ModelPreset(name, make(**{**defaults, **overrides}), family)


def _at_scale(seq: int | None) -> dict[str, Any]:
    """How every model here is built, as large runs train them: its blocks scanned, attention over blocks of
    `ATTENTION_BLOCK` queries (the largest power-of-two part of it that divides the sequence length ``seq``)."""
    return {"scan_layers": True, "attention_block": ATTENTION_BLOCK if seq is None else math.gcd(ATTENTION_BLOCK, seq)}


def llama_shape(
    *, layers: int, d_model: int, heads: int, kv_heads: int | None, ffn: int, vocab: int, seq: int
) -> ModelPreset:
    """A Llama-family model of these dimensions (grouped-query attention with ``kv_heads``)."""
    cfg = LlamaConfig(
        vocab_size=vocab,
        seq_len=seq,
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=kv_heads or heads,
        ffn=ffn,
        n_layers=layers,
        **_at_scale(seq),
    )
    return ModelPreset(f"llama-{layers}x{d_model}", cfg, Llama)


def gpt_shape(
    *,
    layers: int,
    d_model: int,
    heads: int,
    vocab: int,
    seq: int,
    ffn: int | None = None,
    head_dim: int | None = None,
) -> ModelPreset:
    """A GPT-family model of these dimensions (Megatron's shapes: learned positions, a ``4 d_model`` MLP unless
    ``ffn``, heads of ``d_model / heads`` unless ``head_dim``).

    >>> m = gpt_shape(layers=24, d_model=2304, heads=24, vocab=51200, seq=2048)  # Megatron's "1.7B" (head untied)
    >>> m.name, m.config.attention_block, f"{m.config.num_params() / 1e9:.2f}B"
    ('gpt-24x2304', 512, '1.77B')
    """
    cfg = GPTConfig(
        vocab_size=vocab,
        seq_len=seq,
        d_model=d_model,
        n_heads=heads,
        n_layers=layers,
        ffn=ffn,
        head_dim=head_dim,
        **_at_scale(seq),
    )
    return ModelPreset(f"gpt-{layers}x{d_model}", cfg, GPT)
