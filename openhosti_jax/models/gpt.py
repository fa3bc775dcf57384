"""A small decoder-only transformer (Flax nnx) and a byte-level corpus: the library's demo and test model.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.models.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from openhosti_jax.errors import ConfigError
from openhosti_jax.flops import CAUSAL_ATTENTION_COUNTED
from openhosti_jax.models.attention import KERNELS, causal_attention
from openhosti_jax.models.collective import project_in, project_out
from openhosti_jax.models.context import STRATEGIES
from openhosti_jax.models.placement import constrain_activation, constrain_logits, constrain_unsplit, lookup
from openhosti_jax.models.segments import check_segment_ids, segment_positions, target_weights
from openhosti_jax.policies.remat import keep
from openhosti_jax.sharding.rules import LAYER_AXIS
from openhosti_jax.state.blocks import stack_modules


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 256
    """Tokens are bytes by default."""
    seq_len: int = 64
    """Maximum sequence length (learned positions)."""
    d_model: int = 128
    """Residual width."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    n_layers: int = 2
    """Transformer blocks."""
    mlp_ratio: int = 4
    """MLP hidden width / ``d_model`` (where ``ffn`` is not given)."""
    ffn: int | None = None
    """MLP hidden width (None: ``mlp_ratio * d_model``)."""
    head_dim: int | None = None
    """Width of each attention head (None: ``d_model // n_heads``); queries, keys and values are
    ``n_heads * head_dim`` wide."""
    dropout: float = 0.0
    """Dropout rate on attention output and MLP output (needs an ``rng`` at call time when > 0)."""
    dtype: str = "float32"
    """Compute dtype (parameters stay float32)."""
    attention_block: int | None = None
    """Compute attention this many queries at a time, each block recomputed in the backward
    (`openhosti_jax.models.attention.query_blocks`): activations linear in the sequence length, as flash attention's;
    None: the whole ``seq x seq`` score matrix at once."""
    scan_layers: bool = False
    """Stack the blocks' parameters over a leading ``"layers"`` axis and run them with ``nnx.scan``: one compiled
    block, and under ZeRO-3 one layer's parameters gathered at a time (as MaxText's ``scan_layers``)."""
    context_strategy: str = "ring"
    """Under a mesh with a ``context`` axis larger than 1, how attention brings each sequence piece the others' keys
    and values: ``"ring"`` or ``"all_gather"`` (`openhosti_jax.models.context`)."""
    attention_kernel: str = "auto"
    """The attention kernel (`openhosti_jax.models.attention.KERNELS`): ``"auto"`` runs cuDNN's fused attention on a
    GPU in bf16/fp16, the Pallas splash kernel on a TPU (sequences that are multiples of 128) and XLA's elsewhere;
    ``"cudnn"`` or ``"splash"`` where it cannot run is a `ConfigError` when traced."""

    def __post_init__(self) -> None:
        problems = [
            f"{k}={getattr(self, k)!r} must be a positive int"
            for k in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio")
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1
        ]
        problems += [
            f"{k}={getattr(self, k)!r} must be a positive int or None"
            for k in ("ffn", "head_dim")
            if getattr(self, k) is not None and (not isinstance(getattr(self, k), int) or getattr(self, k) < 1)
        ]
        if not problems and self.head_dim is None and self.d_model % self.n_heads:
            problems.append(f"n_heads={self.n_heads} must divide d_model={self.d_model} (or give head_dim)")
        if self.context_strategy not in STRATEGIES:
            problems.append(f"context_strategy={self.context_strategy!r} must be one of {STRATEGIES}")
        if self.attention_kernel not in KERNELS:
            problems.append(f"attention_kernel={self.attention_kernel!r} must be one of {KERNELS}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if problems:
            raise ConfigError("invalid GPTConfig: " + "; ".join(problems))

    @classmethod
    def tiny(cls, **kw: Any) -> GPTConfig:
        """A model small enough for unit tests (~0.2M parameters)."""
        return cls(**{"seq_len": 32, "d_model": 64, "n_heads": 4, "n_layers": 2, **kw})

    @classmethod
    def gpt3_175b(cls, **kw: Any) -> GPTConfig:
        """GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048), with
        Megatron-LM's vocabulary padded to 51200 (175.2B parameters: this family does not tie the head)."""
        return cls(**{"vocab_size": 51200, "seq_len": 2048, "d_model": 12288, "n_heads": 96, "n_layers": 96, **kw})

    @classmethod
    def bert_large(cls, **kw: Any) -> GPTConfig:
        """BERT-Large's shapes (Devlin et al. 2019: 24 layers, d_model 1024, 16 heads, 512 positions, WordPiece
        vocabulary 30522; 0.36B parameters with this family's head): its attention is bidirectional where this
        block is causal, which changes neither the shapes, the FLOPs nor the memory a plan is priced on."""
        return cls(**{"vocab_size": 30522, "seq_len": 512, "d_model": 1024, "n_heads": 16, "n_layers": 24, **kw})

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width."""
        return self.ffn or self.mlp_ratio * self.d_model

    @property
    def attention_width(self) -> int:
        """``n_heads`` x the head width."""
        return self.n_heads * (self.head_dim or self.d_model // self.n_heads)

    def num_params(self) -> int:
        """Exact parameter count (embeddings included)."""
        d, h, a = self.d_model, self.mlp_width, self.attention_width
        block = 2 * 2 * d + 4 * d * a + d + d * h + h + h * d + d
        return (
            self.vocab_size * d
            + self.seq_len * d
            + self.n_layers * block
            + 2 * d
            + d * self.vocab_size
            + self.vocab_size
        )

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward = 3x forward matmuls, attention included): the causal
        attention's scores and weighted values, ``2 * 2 * seq_len * attention_width`` per token and layer over the
        whole square, counted half (`openhosti_jax.flops.CAUSAL_ATTENTION_COUNTED`, MaxText's and Megatron-LM's
        count)."""
        d, h, s, a = self.d_model, self.mlp_width, self.seq_len, self.attention_width
        per_layer = 2 * (4 * d * a + 2 * d * h) + int(2 * 2 * s * a * CAUSAL_ATTENTION_COUNTED)
        return 3 * (self.n_layers * per_layer + 2 * d * self.vocab_size)


def _unnamed(rank: int, scanned: bool) -> dict[str, Any]:
    """Variable metadata with ``rank`` unnamed dims when the block is stacked (``nnx.vmap`` prepends
    ``"layers"``), else none."""
    return {"out_sharding": (None,) * rank, "eager_sharding": False} if scanned else {}


class Block(nnx.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, dt, s = cfg.d_model, jnp.dtype(cfg.dtype), cfg.scan_layers
        norm = {"scale_metadata": _unnamed(1, s), "bias_metadata": _unnamed(1, s)}
        dense = {"kernel_metadata": _unnamed(2, s), "bias_metadata": _unnamed(1, s)}
        self.cfg = cfg
        self.ln1 = nnx.LayerNorm(d, rngs=rngs, dtype=dt, **norm)
        a, h = cfg.attention_width, cfg.mlp_width
        self.qkv = nnx.Linear(d, 3 * a, use_bias=False, rngs=rngs, dtype=dt, **dense)  # a key bias: zero gradient
        self.proj = nnx.Linear(a, d, rngs=rngs, dtype=dt, **dense)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs, dtype=dt, **norm)
        self.fc = nnx.Linear(d, h, rngs=rngs, dtype=dt, **dense)
        self.out = nnx.Linear(h, d, rngs=rngs, dtype=dt, **dense)

    def _drop(self, x: jax.Array, rng: jax.Array | None) -> jax.Array:
        if rng is None or self.cfg.dropout == 0.0:
            return x
        keep = jax.random.bernoulli(rng, 1.0 - self.cfg.dropout, x.shape)
        return jnp.where(keep, x / (1.0 - self.cfg.dropout), 0.0).astype(x.dtype)

    def __call__(self, x: jax.Array, rng: jax.Array | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
        b, s, _ = x.shape
        nh, a = self.cfg.n_heads, self.cfg.attention_width
        r1, r2 = jax.random.split(rng) if rng is not None else (None, None)
        (qkv,) = project_in(self.ln1(x), self.qkv)
        q, k, v = jnp.split(keep(qkv), 3, axis=-1)  # kept: the 1st and 3rd projections
        q, k, v = (t.reshape(b, s, nh, a // nh) for t in (q, k, v))
        cfg = self.cfg
        y = causal_attention(
            q,
            k,
            v,
            block=cfg.attention_block,
            context_strategy=cfg.context_strategy,
            kernel=cfg.attention_kernel,
            segment_ids=segment_ids,
        )
        y = keep(y.reshape(b, s, a))
        x = x + self._drop(project_out(y, self.proj), r1)
        (h,) = project_in(self.ln2(x), self.fc)
        return x + self._drop(project_out(jax.nn.gelu(keep(h)), self.out), r2)


def stacked_blocks(cfg: GPTConfig, rngs: nnx.Rngs) -> Block:
    """One `Block` whose parameters are stacked over a leading ``"layers"`` axis of size ``cfg.n_layers``."""
    return stack_modules(lambda r: Block(cfg, rngs=r), cfg.n_layers, rngs)


@nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
def _scan_blocks(x: jax.Array, block: Block, segment_ids: jax.Array | None) -> jax.Array:
    return block(x, None, segment_ids)


@nnx.scan(in_axes=(nnx.Carry, 0, 0, None), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
def _scan_blocks_rng(x: jax.Array, block: Block, rng: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    return block(x, rng, segment_ids)


class GPT(nnx.Module):
    """Token + position embeddings, ``n_layers`` blocks (a list, or one stacked block with ``scan_layers``), final
    norm, untied output head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs, dtype=dt)
        self.wpe = nnx.Embed(cfg.seq_len, cfg.d_model, rngs=rngs, dtype=dt)
        if cfg.scan_layers:
            self.blocks: Block | nnx.List = stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs, dtype=dt)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, rngs=rngs, dtype=dt)

    def __call__(
        self, tokens: jax.Array, rng: jax.Array | None = None, *, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """float32 logits ``(batch, seq, vocab_size)`` of int ``tokens`` ``(batch, seq)``; ``segment_ids`` (the
        tokens' shape) packs documents into a row (`openhosti_jax.models.segments`): each attends within itself and
        its positions restart at 0, as if run alone."""
        s = tokens.shape[1]
        seg = check_segment_ids(segment_ids, tokens.shape)
        positions = jnp.arange(s)[None] if seg is None else segment_positions(seg)
        x = constrain_activation(lookup(self.wte, tokens) + self.wpe(positions))
        n = self.cfg.n_layers
        if self.cfg.scan_layers:
            x = (
                _scan_blocks(x, self.blocks, seg)
                if rng is None
                else _scan_blocks_rng(x, self.blocks, jax.random.split(rng, n), seg)
            )
        else:
            rngs = jax.random.split(rng, n) if rng is not None else [None] * n
            for block, r in zip(self.blocks, rngs, strict=True):
                x = block(x, r, seg)
        x = constrain_unsplit(self.ln_f(x))  # the vocabulary-parallel head takes the whole sequence
        return constrain_logits(constrain_logits(self.head(x)).astype(jnp.float32))  # split as computed


def next_token_loss(
    logits: jax.Array, tokens: jax.Array, mask: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross-entropies, number of predicted tokens) for ``logits`` of ``tokens``; ``mask``
    weighs each target, ``segment_ids`` drops the targets that start a document or are padding
    (`openhosti_jax.models.segments.target_weights`)."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    weights = jnp.ones_like(nll) if mask is None else mask[:, 1:].astype(nll.dtype)
    if segment_ids is not None:
        weights = weights * target_weights(check_segment_ids(segment_ids, tokens.shape))
    return jnp.sum(nll * weights), jnp.sum(weights)


_CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog while a sharded model learns to predict the next byte "
    "of text across eight simulated devices and every host keeps its checkpoint safe through the night "
).split()


def make_corpus(num_sequences: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """Deterministic byte-level token sequences ``(num_sequences, seq_len)`` int32 built from a word list.

    Word order follows a fixed random bigram table, so the text has structure a model can learn.
    """
    if num_sequences < 1 or seq_len < 2:
        raise ConfigError(f"expected num_sequences >= 1 and seq_len >= 2, found {num_sequences}, {seq_len}")
    rs = np.random.default_rng(seed)
    n = len(_CORPUS_WORDS)
    nxt = rs.integers(0, n, size=(n, 3))
    total = num_sequences * seq_len
    out, w = [], int(rs.integers(n))
    length = 0
    while length < total:
        word = _CORPUS_WORDS[w] + " "
        out.append(word)
        length += len(word)
        w = int(nxt[w, rs.integers(3)])
    data = np.frombuffer("".join(out).encode()[:total], dtype=np.uint8).astype(np.int32)
    return data.reshape(num_sequences, seq_len)
