"""A Llama-family decoder (Flax nnx): RMSNorm, rotary positions, grouped KV heads, SwiGLU MLP, no biases.

Presets (`LlamaConfig.llama2_7b`, ..., `LlamaConfig.llama3_405b`, and the mixtures of experts
`LlamaConfig.mixtral_8x7b` and `LlamaConfig.deepseek_moe_16b`) carry the published shapes, for planning at scale with
``jax.eval_shape``; `LlamaConfig.tiny` is for tests.

With ``num_experts`` > 0 the MLPs (after ``first_dense_layers`` dense ones) are mixture-of-experts blocks
(`openhosti_jax.models.moe`): ``model(tokens, with_aux=True)`` returns ``(logits, aux)``, ``aux`` the blocks'
`MoEAux` stacked over the MoE layers, whose ``aux.loss.sum()`` the training loss adds (`moe_loss`).

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
    >>> LlamaConfig.llama3_8b().num_params()
    8030261248
    >>> moe = Llama(LlamaConfig.tiny(num_experts=4, top_k=2), rngs=nnx.Rngs(0))
    >>> logits, aux = moe(jnp.zeros((2, 16), jnp.int32), with_aux=True)
    >>> logits.shape, aux.expert_counts.shape, int(aux.expert_counts.sum())  # 2 layers x 4 experts, 32 tokens x 2
    ((2, 16, 256), (2, 4), 128)
    >>> m = LlamaConfig.mixtral_8x7b()
    >>> f"{m.num_params() / 1e9:.2f}B total, {m.active_params() / 1e9:.2f}B active"
    '46.70B total, 12.88B active'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from openhosti_jax.errors import ConfigError, StateError
from openhosti_jax.flops import CAUSAL_ATTENTION_COUNTED
from openhosti_jax.models.attention import KERNELS, causal_attention
from openhosti_jax.models.checks import dtype_problem, finite_number, positive_ints
from openhosti_jax.models.collective import project_in, project_out
from openhosti_jax.models.context import STRATEGIES
from openhosti_jax.models.moe import MoEAux, MoEBlock, MoEConfig, moe_layer
from openhosti_jax.models.placement import constrain_logits, constrain_unsplit, lookup
from openhosti_jax.models.segments import check_segment_ids, segment_positions
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
    GPU in bf16/fp16, the Pallas splash kernel on a TPU (sequences that are multiples of 128) and XLA's elsewhere;
    ``"cudnn"`` or ``"splash"`` where it cannot run is a `ConfigError` when traced."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0: every MLP dense (a plain Llama)."""
    top_k: int = 2
    """Experts each token is routed to (MoE only; at most ``num_experts``)."""
    moe_ffn: int | None = None
    """SwiGLU hidden width of each routed (and shared) expert; None: ``ffn``."""
    shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeekMoE)."""
    first_dense_layers: int = 0
    """Leading layers whose MLP stays dense (width ``ffn``), as DeepSeekMoE's first; the rest are MoE."""
    capacity_factor: float | None = None
    """MoE dispatch: None dropless (grouped matmul), else capacity-based with this factor (tokens over capacity
    dropped; `openhosti_jax.models.moe.MoEConfig.capacity`)."""
    aux_loss_weight: float = 0.01
    """Weight of each MoE layer's load-balancing loss in ``aux.loss``."""
    router_z_loss_weight: float = 0.0
    """Weight of each MoE layer's router z-loss in ``aux.loss``."""

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
        problems += self._moe_problems(bad)
        if problems:
            raise ConfigError("invalid LlamaConfig: " + "; ".join(problems))

    def _moe_problems(self, bad: set[str]) -> list[str]:
        e = self.num_experts
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            return [f"num_experts={e!r} must be an int >= 0 (0: dense)"]
        if e == 0:
            return []
        problems = []
        f = self.first_dense_layers
        if not isinstance(f, int) or isinstance(f, bool) or f < 0 or ("n_layers" not in bad and f >= self.n_layers):
            problems.append(f"first_dense_layers={f!r} must be an int in [0, n_layers={self.n_layers})")
        if self.moe_ffn is not None:
            problems += positive_ints({"moe_ffn": self.moe_ffn}, ("moe_ffn",))[1]
        if not problems and not bad & {"d_model", "ffn"}:
            try:
                self.moe_config()
            except ConfigError as err:
                problems.append(str(err).removeprefix("invalid MoEConfig: "))
        return problems

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.n_layers - self.first_dense_layers if self.num_experts else 0

    @property
    def dispatch(self) -> str:
        """``"dropless"`` or ``"capacity"`` (from ``capacity_factor``)."""
        return "dropless" if self.capacity_factor is None else "capacity"

    def moe_config(self) -> MoEConfig:
        """The `MoEConfig` of each MoE layer (`ConfigError` where the fields make none)."""
        return MoEConfig(
            d_model=self.d_model,
            d_ff=self.ffn if self.moe_ffn is None else self.moe_ffn,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_shared_experts=self.shared_experts,
            capacity_factor=self.capacity_factor,
            aux_loss_weight=self.aux_loss_weight,
            router_z_loss_weight=self.router_z_loss_weight,
            dtype=self.dtype,
        )

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

    @classmethod
    def mixtral_8x7b(cls, **kw: Any) -> LlamaConfig:
        """Mixtral 8x7B (Mistral AI, 2024; 46.7B parameters, 12.9B active): 32 layers of width 4096, 32 query heads
        over 8 kv heads, 8 experts of SwiGLU width 14336, top-2, vocab 32000, 32768-token context, RoPE base 1e6."""
        return cls(
            **{
                "vocab_size": 32000,
                "seq_len": 32768,
                "d_model": 4096,
                "n_heads": 32,
                "n_kv_heads": 8,
                "ffn": 14336,
                "n_layers": 32,
                "rope_theta": 1e6,
                "norm_eps": 1e-5,
                "num_experts": 8,
                "top_k": 2,
                **kw,
            }
        )

    @classmethod
    def deepseek_moe_16b(cls, **kw: Any) -> LlamaConfig:
        """DeepSeekMoE 16B (DeepSeek-AI, 2024; 16.4B parameters, 2.8B active): 28 layers of width 2048, 16 heads,
        vocab 102400, 4096-token context; the first layer's MLP dense (width 10944), the other 27 of 64 fine-grained
        routed experts (width 1408, top-6) and 2 shared ones."""
        return cls(
            **{
                "vocab_size": 102400,
                "seq_len": 4096,
                "d_model": 2048,
                "n_heads": 16,
                "n_kv_heads": 16,
                "ffn": 10944,
                "n_layers": 28,
                "norm_eps": 1e-6,
                "num_experts": 64,
                "top_k": 6,
                "moe_ffn": 1408,
                "shared_experts": 2,
                "first_dense_layers": 1,
                **kw,
            }
        )

    def _attention_params_per_layer(self) -> int:
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        return 2 * d * d + 2 * d * kv  # q, o; k, v

    def _matmul_params(self, active: bool) -> int:
        """Matmul weights of all layers (``active``: those one token runs through: its ``top_k`` routed experts)."""
        dense = self._attention_params_per_layer() + 3 * self.d_model * self.ffn
        if not self.num_experts:
            return self.n_layers * dense
        m = self.moe_config()
        experts = (m.top_k if active else m.num_experts) + m.num_shared_experts
        moe = self._attention_params_per_layer() + self.d_model * m.num_experts + 3 * self.d_model * m.d_ff * experts
        return self.first_dense_layers * dense + self.moe_layers * moe

    def num_params(self) -> int:
        """Exact parameter count (embeddings included; the head once more unless tied), from the shapes alone."""
        d, v = self.d_model, self.vocab_size
        norms = self.n_layers * 2 * d + d
        return v * d + self._matmul_params(False) + norms + (0 if self.tie_embeddings else d * v)

    def active_params(self) -> int:
        """Parameters one token runs through: `num_params` with each MoE layer's routed experts counted ``top_k``
        times, not ``num_experts`` (the same for a dense model)."""
        return self.num_params() - self._matmul_params(False) + self._matmul_params(True)

    def flops_per_token(self) -> int:
        """Training FLOPs per token at ``seq_len``: 3 x the forward's matmuls (backward = 2 x forward), over the
        active parameters.

        ``6 * (active matmul params + d_model * vocab_size) + 6 * n_layers * d_model * seq_len``: a matmul with P
        weights costs 2P FLOPs per token; an MoE layer's are its router, ``top_k`` routed experts and the shared
        ones (dispatch, padding and dropped tokens not counted); the head is a matmul, tied or not, the embedding
        lookup is not; attention scores ``q.k`` and the weighted sum of values cost ``2 * seq_len * d_model`` each
        per token and layer over the full ``seq_len x seq_len`` square, ``12 * n_layers * d_model * seq_len`` for
        the step, of which the causal half counts (`openhosti_jax.flops.CAUSAL_ATTENTION_COUNTED`, MaxText's and
        Megatron-LM's count; the trace computes the whole square). Norms, RoPE, softmax and SiLU are not counted.
        """
        d, s = self.d_model, self.seq_len
        attention = int(12 * self.n_layers * d * s * CAUSAL_ATTENTION_COUNTED)
        return 6 * (self._matmul_params(True) + d * self.vocab_size) + attention


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


def rope_tables(
    seq_len: int, head_dim: int, theta: float, positions: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each ``(seq_len, head_dim // 2)`` float32: angle ``p * theta ** (-2i / head_dim)`` of position
    ``p`` and frequency ``i``; with ``positions`` ``(batch, seq_len)``, each ``(batch, seq_len, head_dim // 2)`` at
    those positions (packed documents)."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    p = jnp.arange(seq_len, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angles = p[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``(batch, seq, heads, head_dim)``: feature ``i`` of the first half pairs with feature ``i`` of
    the second half (the Hugging Face layout), rotated by the angle of ``(cos, sin)`` ``([batch,] seq, head_dim //
    2)``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None], sin[:, :, None])
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Block(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + down(silu(gate(h)) * up(h))`` with ``h = norm(x)``; with
    ``moe``, ``x + moe(h)`` (`openhosti_jax.models.moe.moe_layer`) and the call returns ``(x, aux)``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, moe: bool = False):
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
        if moe:
            self.moe = MoEBlock(cfg.moe_config(), rngs=rngs)
        else:
            self.gate = dense(d, cfg.ffn, "embed", "mlp")
            self.up = dense(d, cfg.ffn, "embed", "mlp")
            self.down = dense(cfg.ffn, d, "mlp", "embed")

    def attention(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """Causal grouped-query self-attention of normed ``x`` ``(batch, seq, d_model)`` (within each segment)."""
        b, s, d = x.shape
        kvh, hd = self.cfg.n_kv_heads, self.cfg.head_dim
        group = self.cfg.n_heads // kvh
        q, k, v = project_in(x, self.wq, self.wk, self.wv)
        q = apply_rope(keep(q).reshape(b, s, kvh * group, hd), cos, sin)  # kept: every other projection
        k = apply_rope(k.reshape(b, s, kvh, hd), cos, sin)
        v = keep(v).reshape(b, s, kvh, hd)
        cfg = self.cfg  # query head h reads kv head h // group
        y = causal_attention(
            q,
            k,
            v,
            block=cfg.attention_block,
            context_strategy=cfg.context_strategy,
            kernel=cfg.attention_kernel,
            segment_ids=segment_ids,
        )
        y = keep(y.reshape(b, s, d))
        return project_out(y, self.wo)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, MoEAux]:
        x = x + self.attention(self.attn_norm(x), cos, sin, segment_ids)
        h = self.mlp_norm(x)
        if hasattr(self, "moe"):
            y, aux = moe_layer(self.moe.config(), self.moe.weights(), h)
            return x + y, aux
        gate, up = project_in(h, self.gate, self.up)
        return x + keep(project_out(jax.nn.silu(keep(gate)) * up, self.down))


def stacked_blocks(cfg: LlamaConfig, rngs: nnx.Rngs, *, n: int | None = None, moe: bool = False) -> Block:
    """One `Block` whose parameters are stacked over a leading ``"layers"`` axis of size ``n`` (default
    ``cfg.n_layers``)."""
    return stack_modules(lambda r: Block(cfg, rngs=r, moe=moe), cfg.n_layers if n is None else n, rngs)


_AXES = (nnx.Carry, 0, None, None, None)


@nnx.scan(in_axes=_AXES, out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
def _scan_blocks(x: jax.Array, block: Block, cos: jax.Array, sin: jax.Array, seg: jax.Array | None) -> jax.Array:
    return block(x, cos, sin, seg)


@nnx.scan(in_axes=_AXES, out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
def _scan_moe_blocks(
    x: jax.Array, block: Block, cos: jax.Array, sin: jax.Array, seg: jax.Array | None
) -> tuple[jax.Array, MoEAux]:
    return block(x, cos, sin, seg)


def moe_loss(aux: MoEAux | None) -> jax.Array:
    """The auxiliary loss to add to the training loss: the MoE layers' ``aux.loss`` summed (0 for a dense model's
    None)."""
    return jnp.zeros((), jnp.float32) if aux is None else jnp.sum(aux.loss)


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
        first = cfg.first_dense_layers if cfg.num_experts else cfg.n_layers  # the dense layers before any MoE one
        if cfg.scan_layers and cfg.num_experts:  # two stacks: the leading dense layers (if any), then the MoE ones
            if first:
                self.dense_blocks = stacked_blocks(cfg, rngs, n=first)
            self.blocks: Block | nnx.List = stacked_blocks(cfg, rngs, n=cfg.moe_layers, moe=True)
        elif cfg.scan_layers:
            self.blocks = stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs, moe=i >= first) for i in range(cfg.n_layers)])
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

    def __call__(
        self,
        tokens: jax.Array,
        rng: jax.Array | None = None,
        *,
        with_aux: bool = False,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, MoEAux | None]:
        """float32 logits ``(batch, seq, vocab_size)`` of int ``tokens`` ``(batch, seq)``, ``seq <= seq_len``;
        ``with_aux``: ``(logits, aux)``, ``aux`` the MoE layers' `MoEAux` stacked over them (None when dense).
        ``segment_ids`` (the tokens' shape) packs documents into a row (`openhosti_jax.models.segments`): each
        attends within itself and its rotary positions restart at 0, as if run alone.

        ``rng`` is accepted for the `GPT` calling convention and unused (Llama has no dropout).
        """
        del rng
        s = tokens.shape[1]
        if s > self.cfg.seq_len:
            raise StateError(f"expected at most seq_len={self.cfg.seq_len} tokens per sequence, found {s}")
        seg = check_segment_ids(segment_ids, tokens.shape)
        positions = None if seg is None else segment_positions(seg)
        cos, sin = rope_tables(s, self.cfg.head_dim, self.cfg.rope_theta, positions)
        x = lookup(self.embed, tokens)
        auxes: list[MoEAux] = []
        if self.cfg.scan_layers and self.cfg.num_experts:
            if hasattr(self, "dense_blocks"):
                x = _scan_blocks(x, self.dense_blocks, cos, sin, seg)
            x, stacked = _scan_moe_blocks(x, self.blocks, cos, sin, seg)
            auxes = [stacked]
        elif self.cfg.scan_layers:
            x = _scan_blocks(x, self.blocks, cos, sin, seg)
        else:
            for block in self.blocks:
                x = block(x, cos, sin, seg)
                if isinstance(x, tuple):
                    x, aux = x
                    auxes.append(jax.tree.map(lambda v: v[None], aux))
        x = constrain_unsplit(self.norm(x))  # the vocabulary-parallel head takes the whole sequence
        logits = constrain_logits(self.embed.attend(x) if self.head is None else self.head(x))  # split as computed
        logits = constrain_logits(logits.astype(jnp.float32))
        if not with_aux:
            return logits
        aux = jax.tree.map(lambda *v: jnp.concatenate(v), *auxes) if auxes else None
        return logits, aux
