"""A BERT encoder with a sequence-classification head (Flax nnx): word, position and token-type embeddings, post-norm
blocks of bidirectional self-attention (padding masked) and an exact-GELU MLP, a tanh pooler on the first token,
a linear classifier. The layout of Devlin et al. 2019 and of transformers' ``BertForSequenceClassification``.

`BertConfig.large` carries BERT-Large's shapes for planning at scale with ``jax.eval_shape``; `BertConfig.tiny` is
for tests. The model takes token ids, or a whole fine-tuning batch as `BertConfig.sample_batch` lays it out.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.models.bert import Bert, BertConfig
    >>> model = Bert(BertConfig.tiny(), rngs=nnx.Rngs(0))
    >>> tokens = jnp.ones((2, 16), jnp.int32)
    >>> model(tokens, attention_mask=jnp.arange(16)[None, :] < jnp.array([[16], [9]])).shape
    (2, 2)
    >>> f"{BertConfig.large().num_params():,}"
    '335,215,618'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from openhosti_jax.errors import BatchError, ConfigError
from openhosti_jax.models.attention import query_blocks
from openhosti_jax.models.checks import dtype_problem, finite_number, positive_ints
from openhosti_jax.policies.remat import keep
from openhosti_jax.sharding.rules import LAYER_AXIS
from openhosti_jax.state.blocks import stack_modules

_POSITIVE_INTS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "ffn", "type_vocab_size", "n_classes")
BATCH_KEYS = ("tokens", "token_types", "attention_mask", "labels")
"""The keys of a batch given as a mapping (`BertConfig.sample_batch`); ``labels`` is the loss's, the model ignores
it."""


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shape of the model."""

    vocab_size: int
    """WordPiece vocabulary size (embedding rows)."""
    seq_len: int
    """Maximum sequence length: the learned position embeddings' rows."""
    d_model: int
    """Hidden width."""
    n_heads: int
    """Attention heads; must divide ``d_model``."""
    n_layers: int
    """Encoder blocks."""
    ffn: int
    """MLP hidden width (BERT's ``intermediate_size``)."""
    type_vocab_size: int = 2
    """Token types (segments A and B)."""
    n_classes: int = 2
    """Classifier outputs."""
    dropout: float = 0.1
    """Dropout rate on the embeddings, the attention probabilities, each block's two residual branches and the
    pooled output, applied only when the call gets an ``rng``."""
    norm_eps: float = 1e-12
    """LayerNorm epsilon."""
    dtype: str = "float32"
    """Compute dtype (parameters stay float32, logits are float32)."""
    scan_layers: bool = False
    """Stack the blocks' parameters over a leading ``"layers"`` axis and run them with ``nnx.scan``."""
    attention_block: int | None = None
    """Queries per attention block (`openhosti_jax.models.attention.query_blocks`, each block recomputed in the
    backward); None: all at once."""

    def __post_init__(self) -> None:
        bad, problems = positive_ints({k: getattr(self, k) for k in _POSITIVE_INTS}, _POSITIVE_INTS)
        if not bad & {"d_model", "n_heads"} and self.d_model % self.n_heads:
            problems.append(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.attention_block is not None:
            problems += positive_ints({"attention_block": self.attention_block}, ["attention_block"])[1]
        problems += [p for p in [finite_number("norm_eps", self.norm_eps, minimum=0, strict=True)] if p]
        if finite_number("dropout", self.dropout, minimum=0, strict=False) or self.dropout >= 1:
            problems.append(f"dropout={self.dropout!r} must be a number in [0, 1)")
        if not isinstance(self.scan_layers, bool):
            problems.append(f"scan_layers={self.scan_layers!r} must be a bool")
        problems += [p for p in [dtype_problem(self.dtype)] if p]
        if problems:
            raise ConfigError("invalid BertConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @classmethod
    def tiny(cls, **kw: Any) -> BertConfig:
        """A model small enough for unit tests (23K parameters)."""
        return cls(**{"vocab_size": 128, "seq_len": 32, "d_model": 32, "n_heads": 4, "n_layers": 2, "ffn": 64, **kw})

    @classmethod
    def large(cls, **kw: Any) -> BertConfig:
        """BERT-Large (Devlin et al. 2019: 24 layers, hidden 1024, 16 heads, MLP 4096, 512 positions, 2 token types).

        The WordPiece vocabulary of 30522 is padded to 30592, the next multiple of 128, as Megatron-LM pads it, so
        that the embedding's rows split evenly over a tensor axis (of up to 128 devices). With that padding and a
        two-class head it has 335,215,618 parameters; the released checkpoint's encoder and pooler hold
        335,141,888 (the paper rounds to 340M)."""
        return cls(
            **{"vocab_size": 30592, "seq_len": 512, "d_model": 1024, "n_heads": 16, "n_layers": 24, "ffn": 4096, **kw}
        )

    def sample_batch(self, batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """An abstract fine-tuning batch of ``batch`` sequences of ``seq_len`` tokens: int32 ``tokens``,
        ``token_types`` and ``attention_mask`` ``(batch, seq_len)``, and a class label per sequence, ``labels``
        ``(batch,)`` (the model reads the first three; the loss reads the labels)."""
        seq = jax.ShapeDtypeStruct((batch, self.seq_len), jnp.int32)
        return {
            "tokens": seq,
            "token_types": seq,
            "attention_mask": seq,
            "labels": jax.ShapeDtypeStruct((batch,), jnp.int32),
        }

    def _matmul_params_per_layer(self) -> int:
        return 4 * self.d_model * self.d_model + 2 * self.d_model * self.ffn  # q, k, v, out; MLP in and out

    def num_params(self) -> int:
        """Exact parameter count from the shapes: embeddings and their norm, the blocks, the pooler, the head."""
        d, f = self.d_model, self.ffn
        embeddings = (self.vocab_size + self.seq_len + self.type_vocab_size) * d + 2 * d
        per_layer = self._matmul_params_per_layer() + 4 * d + f + d + 2 * (2 * d)  # + biases, + two LayerNorms
        return embeddings + self.n_layers * per_layer + (d * d + d) + (d * self.n_classes + self.n_classes)

    def flops_per_token(self) -> float:
        """Training FLOPs per token at ``seq_len``: 3 x the forward's matmuls (backward = 2 x forward).

        ``6 * n_layers * matmul params per layer + 12 * n_layers * d_model * seq_len + 6 * (d_model ** 2 + d_model
        * n_classes) / seq_len``: a matmul with P weights costs 2P FLOPs per token it runs on; attention's scores
        and weighted values cost ``2 * seq_len * d_model`` each per token and layer over the whole (bidirectional)
        square; the pooler and the classifier run on one token per sequence, their FLOPs spread over its
        ``seq_len`` tokens. Embedding lookups, norms, softmax and GELU are not counted.
        """
        d, s, layers = self.d_model, self.seq_len, self.n_layers
        heads = 6 * (d * d + d * self.n_classes) / s
        return 6 * layers * self._matmul_params_per_layer() + 12 * layers * d * s + heads


_INIT = nnx.initializers.normal(0.02)


def _named(*names: str | None) -> dict[str, Any]:
    """Variable metadata naming each dim logically (`openhosti_jax.sharding.rules`: ``"heads"``, ``"kv_heads"``,
    ``"mlp"``, ``"vocab"`` split over ``tensor``; a stacked block's ``nnx.vmap`` prepends ``"layers"``), applied by
    the plan, not at init."""
    return {"out_sharding": names, "eager_sharding": False}


def _dense(n_in: int, n_out: int, names: tuple[str | None, str | None], dt: Any, rngs: nnx.Rngs) -> nnx.Linear:
    """A biased ``(n_in, n_out)`` projection whose kernel dims are ``names`` and whose bias is named as the output."""
    return nnx.Linear(
        n_in,
        n_out,
        dtype=dt,
        kernel_init=_INIT,
        kernel_metadata=_named(*names),
        bias_metadata=_named(names[1]),
        rngs=rngs,
    )


def _norm(cfg: BertConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm over the hidden width, variance in two passes (as torch's, not ``E[x^2] - E[x]^2``)."""
    return nnx.LayerNorm(
        cfg.d_model,
        epsilon=cfg.norm_eps,
        dtype=jnp.dtype(cfg.dtype),
        use_fast_variance=False,
        scale_metadata=_named("norm"),
        bias_metadata=_named("norm"),
        rngs=rngs,
    )


def _dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout of ``x`` at ``rate`` (nothing without an ``rng`` or at rate 0)."""
    if rng is None or rate == 0.0:
        return x
    kept = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(kept, x / (1.0 - rate), 0.0).astype(x.dtype)


def bidirectional_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    *,
    block: int | None = None,
    dropout: float = 0.0,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Every query attends to every key that ``mask`` ``(batch, seq)`` keeps (None: all of them): ``q``, ``k``,
    ``v`` and the output are ``(batch, seq, heads, head_dim)``, scores scaled by ``head_dim ** -0.5`` and
    softmaxed in float32; ``block`` queries at a time (`query_blocks`) where given; the probabilities dropped at
    ``dropout`` where an ``rng`` is given (the same ones whatever ``block``).

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.key(0), (1, 4, 1, 2))
    >>> pad = jnp.array([[True, True, False, False]])
    >>> y = bidirectional_attention(x, x, x.at[:, 2:].set(1e6), pad)  # padded values reach nothing
    >>> bool(jnp.allclose(y, bidirectional_attention(x, x, x, pad), atol=1e-6))
    True
    """
    hd = q.shape[-1]

    def attend(qb: jax.Array, first: jax.Array) -> jax.Array:
        att = jnp.einsum("bqhd,bkhd->bhqk", qb, k, preferred_element_type=jnp.float32) * hd**-0.5
        if mask is not None:
            att = jnp.where(mask[:, None, None, :], att, jnp.finfo(att.dtype).min)
        probs = jax.nn.softmax(att, axis=-1)
        if rng is not None and dropout > 0.0:
            probs = jnp.where(_row_keep(rng, first, probs.shape, dropout), probs / (1.0 - dropout), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)

    return query_blocks(attend, q, block)


def _row_keep(rng: jax.Array, first: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Which attention probabilities of ``shape`` ``(batch, heads, queries, keys)`` dropout keeps, for queries
    ``first, first + 1, ...``: each query's row drawn from its own key (``rng`` folded with its position), so the
    draw is the same whatever the query blocks."""
    b, h, q, k = shape
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, first + jnp.arange(q))
    rows = jax.vmap(lambda key: jax.random.bernoulli(key, 1.0 - rate, (b, h, k)))(keys)
    return jnp.moveaxis(rows, 0, 2)


class Block(nnx.Module):
    """Post-norm encoder block: ``x = norm(x + attn(x))``, then ``norm(x + out(gelu(up(x))))``."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.wq = _dense(d, d, ("embed", "heads"), dt, rngs)  # column-parallel: heads over tensor
        self.wk = _dense(d, d, ("embed", "kv_heads"), dt, rngs)
        self.wv = _dense(d, d, ("embed", "kv_heads"), dt, rngs)
        self.wo = _dense(d, d, ("heads", "embed"), dt, rngs)  # row-parallel: one all-reduce per attention
        self.attn_norm = _norm(cfg, rngs)
        self.up = _dense(d, cfg.ffn, ("embed", "mlp"), dt, rngs)
        self.down = _dense(cfg.ffn, d, ("mlp", "embed"), dt, rngs)
        self.mlp_norm = _norm(cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None, rng: jax.Array | None = None) -> jax.Array:
        b, s, d = x.shape
        cfg = self.cfg
        r_att, r_attn_out, r_mlp = jax.random.split(rng, 3) if rng is not None else (None, None, None)
        heads = (b, s, cfg.n_heads, cfg.head_dim)
        q = keep(self.wq(x)).reshape(heads)  # kept: every other projection and the attention output
        k = self.wk(x).reshape(heads)
        v = keep(self.wv(x)).reshape(heads)
        y = bidirectional_attention(q, k, v, mask, block=cfg.attention_block, dropout=cfg.dropout, rng=r_att)
        x = self.attn_norm(x + _dropout(self.wo(keep(y.reshape(b, s, d))), cfg.dropout, r_attn_out))
        h = jax.nn.gelu(keep(self.up(x)), approximate=False)  # BERT's GELU is the exact, erf one
        return self.mlp_norm(x + _dropout(self.down(h), cfg.dropout, r_mlp))


def stacked_blocks(cfg: BertConfig, rngs: nnx.Rngs) -> Block:
    """One `Block` whose parameters are stacked over a leading ``"layers"`` axis of size ``cfg.n_layers``."""
    return stack_modules(lambda r: Block(cfg, rngs=r), cfg.n_layers, rngs)


@nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
def _scan_blocks(x: jax.Array, block: Block, mask: jax.Array | None) -> jax.Array:
    return block(x, mask)


@nnx.scan(in_axes=(nnx.Carry, 0, None, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
def _scan_blocks_rng(x: jax.Array, block: Block, mask: jax.Array | None, rng: jax.Array) -> jax.Array:
    return block(x, mask, rng)


class Bert(nnx.Module):
    """Embeddings (word + position + token type, then LayerNorm), ``n_layers`` post-norm blocks (a list, or one
    stacked block with ``scan_layers``), a tanh pooler on the first token, a linear classifier. Weights are
    initialised ``normal(0.02)``, biases to zero, norms to one."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
        self.cfg = cfg

        def embed(rows: int, name: str | None) -> nnx.Embed:
            return nnx.Embed(
                rows, d, dtype=dt, embedding_init=_INIT, embedding_metadata=_named(name, "embed"), rngs=rngs
            )

        self.word = embed(cfg.vocab_size, "vocab")  # rows over tensor (the vocabulary is padded to split)
        self.position = embed(cfg.seq_len, None)
        self.token_type = embed(cfg.type_vocab_size, None)
        self.embed_norm = _norm(cfg, rngs)
        if cfg.scan_layers:
            self.blocks: Block | nnx.List = stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.pooler = _dense(d, d, ("embed", "embed"), dt, rngs)
        self.classifier = _dense(d, cfg.n_classes, ("embed", None), dt, rngs)

    def __call__(
        self,
        tokens: jax.Array | Mapping[str, jax.Array],
        token_types: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        """float32 class logits ``(batch, n_classes)`` of int ``tokens`` ``(batch, seq)``, ``seq <= seq_len``.

        ``token_types`` ``(batch, seq)``: each token's segment (None: all 0). ``attention_mask`` ``(batch, seq)``:
        nonzero (True) where a token is real, zero at padding, which no query attends to (None: every token is
        real). ``tokens`` may instead be a batch mapping as `BertConfig.sample_batch` lays it out (the other two
        arguments then come from it; its ``labels`` are ignored). ``rng``: dropout at ``cfg.dropout`` (None: no
        dropout, as for evaluation).
        """
        tokens, token_types, attention_mask = _inputs(tokens, token_types, attention_mask)
        cfg = self.cfg
        b, s = tokens.shape
        if s > cfg.seq_len:
            raise BatchError(f"expected at most seq_len={cfg.seq_len} tokens per sequence, found {s}")
        types = jnp.zeros_like(tokens) if token_types is None else token_types
        mask = None if attention_mask is None else attention_mask.astype(bool)
        r_embed, r_blocks, r_pool = jax.random.split(rng, 3) if rng is not None else (None, None, None)

        x = self.word(tokens) + self.token_type(types) + self.position(jnp.arange(s))[None]
        x = _dropout(self.embed_norm(x), cfg.dropout, r_embed)
        if cfg.scan_layers:
            x = (
                _scan_blocks(x, self.blocks, mask)
                if r_blocks is None
                else _scan_blocks_rng(x, self.blocks, mask, jax.random.split(r_blocks, cfg.n_layers))
            )
        else:
            keys = [None] * cfg.n_layers if r_blocks is None else list(jax.random.split(r_blocks, cfg.n_layers))
            for block, key in zip(self.blocks, keys, strict=True):
                x = block(x, mask, key)
        pooled = _dropout(jnp.tanh(self.pooler(x[:, 0])), cfg.dropout, r_pool)
        return self.classifier(pooled).astype(jnp.float32)


def _inputs(
    tokens: jax.Array | Mapping[str, jax.Array], token_types: jax.Array | None, attention_mask: jax.Array | None
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """(tokens, token_types, attention_mask) from the call's arguments or a batch mapping, their shapes checked."""
    if isinstance(tokens, Mapping):
        batch = tokens
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if "tokens" not in batch or unknown:
            raise BatchError(f"a batch mapping needs 'tokens' and may hold only {BATCH_KEYS}; found {sorted(batch)}")
        if token_types is not None or attention_mask is not None:
            raise BatchError("give token_types and attention_mask in the batch mapping or as arguments, not both")
        tokens, token_types, attention_mask = batch["tokens"], batch.get("token_types"), batch.get("attention_mask")
    if jnp.ndim(tokens) != 2:
        raise BatchError(f"expected tokens of shape (batch, seq), found shape {jnp.shape(tokens)}")
    for name, value in (("token_types", token_types), ("attention_mask", attention_mask)):
        if value is not None and jnp.shape(value) != jnp.shape(tokens):
            raise BatchError(f"{name} has shape {jnp.shape(value)}; expected the tokens' {jnp.shape(tokens)}")
    return tokens, token_types, attention_mask


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of float ``logits`` ``(batch, n_classes)`` against int ``labels`` ``(batch,)``.

    >>> import jax.numpy as jnp
    >>> round(float(classification_loss(jnp.zeros((3, 4)), jnp.array([0, 1, 3]))), 4)  # log 4
    1.3863
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))
