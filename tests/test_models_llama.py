"""The Llama model against independent references: transformers' FlaxLlamaForCausalLM with the same weights, a
numpy RoPE, the jaxpr FLOP counter, the published parameter counts; scanned layers against the list of blocks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from openhosti_jax.errors import ConfigError, StateError
from openhosti_jax.flops import CAUSAL_ATTENTION_COUNTED, jaxpr_flops
from openhosti_jax.models.gpt import next_token_loss
from openhosti_jax.models.llama import Llama, LlamaConfig, apply_rope, rope_tables
from openhosti_jax.sharding.rules import LAYER_AXIS, logical_names

PRESETS = ("llama2_7b", "llama2_70b", "llama3_8b", "llama3_70b", "llama3_405b")


def _params(model: Llama) -> dict[str, Any]:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _load(model: Llama, pure: dict[str, Any]) -> None:
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def _layers(pure: dict[str, Any], cfg: LlamaConfig) -> list[dict[str, Any]]:
    """Per-layer parameter dicts, unstacked when the model is scanned."""
    if cfg.scan_layers:
        return [jax.tree.map(lambda a, i=i: a[i], pure["blocks"]) for i in range(cfg.n_layers)]
    return [pure["blocks"][i] for i in range(cfg.n_layers)]


def _stack(pure_list: dict[str, Any], cfg: LlamaConfig) -> dict[str, Any]:
    """The list model's parameters laid out for the scanned model."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *_layers(pure_list, cfg))
    return {**pure_list, "blocks": stacked}


def _random_model(cfg: LlamaConfig, seed: int = 0) -> Llama:
    """A model whose norm weights are random too (ones would hide a missing or misplaced scale) and whose kernels
    are 4x the init (std 0.08, so attention is far from uniform and a wrong rotation or head grouping shows)."""
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    pure = _params(model)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 8))

    def jitter(path: tuple[Any, ...], a: jax.Array) -> jax.Array:
        name = getattr(path[-1], "key", None)
        if name == "weight":
            return a + 0.1 * jax.random.normal(next(keys), a.shape)
        return 4.0 * a if name == "kernel" else a

    _load(model, jax.tree_util.tree_map_with_path(jitter, pure))
    return model


def _hf_logits(cfg: LlamaConfig, pure: dict[str, Any], tokens: np.ndarray) -> np.ndarray:
    """Logits of transformers' FlaxLlamaForCausalLM given our weights (its kernels are (in, out), as ours)."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        attention_bias=False,
        tie_word_embeddings=False,
    )
    hf = transformers.FlaxLlamaForCausalLM(hf_cfg, input_shape=(1, cfg.seq_len), seed=0, _do_init=True)
    embedding = np.asarray(pure["embed"]["embedding"])
    layers = {}
    for i, p in enumerate(_layers(pure, cfg)):
        k = lambda name, p=p: {"kernel": np.asarray(p[name]["kernel"])}
        layers[str(i)] = {
            "input_layernorm": {"weight": np.asarray(p["attn_norm"]["weight"])},
            "self_attn": {"q_proj": k("wq"), "k_proj": k("wk"), "v_proj": k("wv"), "o_proj": k("wo")},
            "post_attention_layernorm": {"weight": np.asarray(p["mlp_norm"]["weight"])},
            "mlp": {"gate_proj": k("gate"), "up_proj": k("up"), "down_proj": k("down")},
        }
    params = {
        "model": {
            "embed_tokens": {"embedding": embedding},
            "layers": layers,
            "norm": {"weight": np.asarray(pure["norm"]["weight"])},
        },
        "lm_head": {"kernel": embedding.T if cfg.tie_embeddings else np.asarray(pure["head"]["kernel"])},
    }
    shapes = jax.tree.map(np.shape, params)
    assert shapes == jax.tree.map(np.shape, hf.params), "weight mapping does not cover HF's tree exactly"
    return np.asarray(hf(tokens, params=params).logits)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "overrides",
    [{}, {"scan_layers": True}, {"tie_embeddings": True}, {"n_kv_heads": 4}, {"n_kv_heads": 1, "n_layers": 3}],
    ids=["list", "scanned", "tied", "mha", "mqa-3-layers"],
)
@pytest.mark.slow  # 15 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_matches_transformers_flax_llama(overrides):
    cfg = LlamaConfig.tiny(norm_eps=1e-5, **overrides)
    model = _random_model(cfg)
    tokens = np.asarray(jax.random.randint(jax.random.key(7), (3, cfg.seq_len), 0, cfg.vocab_size), np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)))
    ref = _hf_logits(cfg, _params(model), tokens)
    assert ours.dtype == np.float32 and ours.shape == (3, cfg.seq_len, cfg.vocab_size)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    # a shorter batch uses the first positions only
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens[:, :9]))), ours[:, :9], atol=1e-5, rtol=1e-5)


def test_rope_matches_complex_rotation():
    """RoPE as multiplication of ``x[:h] + i x[h:]`` by ``exp(i p theta^(-2j/hd))`` in numpy, at Llama-3's theta."""
    b, s, h, hd, theta = 2, 11, 3, 16, 500000.0
    x = np.asarray(jax.random.normal(jax.random.key(0), (b, s, h, hd)), np.float64)
    z = x[..., : hd // 2] + 1j * x[..., hd // 2 :]
    freq = theta ** (-np.arange(0, hd, 2) / hd)
    z = z * np.exp(1j * np.arange(s)[:, None] * freq[None, :])[None, :, None, :]
    ref = np.concatenate([z.real, z.imag], axis=-1)
    cos, sin = rope_tables(s, hd, theta)
    out = np.asarray(apply_rope(jnp.asarray(x, jnp.float32), cos, sin))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    # scores depend on relative position only
    q0, k0 = x[0, 0, 0], x[1, 0, 0]
    qs = np.asarray(apply_rope(jnp.broadcast_to(jnp.asarray(q0, jnp.float32), (1, s, 1, hd)), cos, sin))[0, :, 0]
    ks = np.asarray(apply_rope(jnp.broadcast_to(jnp.asarray(k0, jnp.float32), (1, s, 1, hd)), cos, sin))[0, :, 0]
    np.testing.assert_allclose(qs[5] @ ks[2], qs[9] @ ks[6], atol=1e-4)


@pytest.mark.slow  # 24 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
def test_scanned_equals_list_logits_and_grads():
    cfg = LlamaConfig.tiny(n_layers=3)
    listed = _random_model(cfg)
    scanned = Llama(LlamaConfig.tiny(n_layers=3, scan_layers=True), rngs=nnx.Rngs(1))
    _load(scanned, _stack(_params(listed), cfg))
    tokens = jax.random.randint(jax.random.key(3), (4, cfg.seq_len), 0, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(scanned(tokens)), np.asarray(listed(tokens)), atol=1e-5, rtol=1e-5)

    def grads(model: Llama) -> dict[str, Any]:
        graphdef, state = nnx.split(model)

        def loss(st: Any) -> jax.Array:
            total, count = next_token_loss(nnx.merge(graphdef, st)(tokens), tokens)
            return total / count

        return nnx.to_pure_dict(jax.grad(loss)(state))

    g_list, g_scan = grads(listed), grads(scanned)
    expected = _stack(g_list, cfg)
    assert jax.tree.structure(expected) == jax.tree.structure(g_scan)
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_scan)) > 1e-3  # not trivially zero


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("scan", [False, True])
def test_num_params_counts_the_real_tiny_model(tie, scan):
    cfg = LlamaConfig.tiny(tie_embeddings=tie, scan_layers=scan)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == cfg.num_params()


def test_num_params_match_published_counts():
    # exact counts of the released checkpoints (sum of the safetensors' shapes)
    assert LlamaConfig.llama2_7b().num_params() == 6_738_415_616
    assert LlamaConfig.llama2_70b().num_params() == 68_976_648_192
    assert LlamaConfig.llama3_8b().num_params() == 8_030_261_248
    assert LlamaConfig.llama3_70b().num_params() == 70_553_706_496
    assert LlamaConfig.llama3_405b().num_params() == 405_853_388_800
    assert LlamaConfig.llama3_8b(seq_len=131072).num_params() == 8_030_261_248  # positions are not parameters
    cfg = LlamaConfig.llama3_8b(tie_embeddings=True)
    assert cfg.num_params() == 8_030_261_248 - 128256 * 4096


@pytest.mark.parametrize("name", PRESETS)
def test_presets_have_published_shapes(name):
    cfg = getattr(LlamaConfig, name)()
    assert cfg.head_dim == 128 and not cfg.tie_embeddings and cfg.norm_eps == 1e-5
    if name.startswith("llama2"):
        assert (cfg.vocab_size, cfg.seq_len, cfg.rope_theta) == (32000, 4096, 10000.0)
    else:
        assert (cfg.vocab_size, cfg.seq_len, cfg.rope_theta) == (128256, 8192, 500000.0)
    assert getattr(LlamaConfig, name)(seq_len=2048, scan_layers=True).seq_len == 2048


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scan", [False, True])
def test_llama3_8b_builds_abstractly(scan):
    cfg = LlamaConfig.llama3_8b(scan_layers=scan)
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    leaves = jax.tree.leaves(params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(int(np.prod(x.shape)) for x in leaves) == cfg.num_params() == 8_030_261_248
    names = logical_names(params)
    if scan:
        stacked = params["blocks"]["wk"]["kernel"]
        assert stacked.shape == (32, 4096, 1024)
        assert sum(n is not None and n[0] == LAYER_AXIS for n in names) == 9  # every block parameter
    else:
        assert params["blocks"][0]["wk"]["kernel"].shape == (4096, 1024)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", PRESETS)
def test_presets_build_abstractly_scanned(name):
    cfg = getattr(LlamaConfig, name)(scan_layers=True)
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))) == cfg.num_params()


def _forward_matmul_flops(cfg: LlamaConfig) -> float:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
    return jaxpr_flops(lambda st, t: nnx.merge(graphdef, st)(t), state, tokens, matmul_only=True)


def _masked_half(cfg: LlamaConfig) -> float:
    """The attention FLOPs per token the trace computes (every block of the square, the masked ones too) and the
    model FLOPs do not count: the masked half of ``12 L d s``."""
    return 12 * cfg.n_layers * cfg.d_model * cfg.seq_len * (1 - CAUSAL_ATTENTION_COUNTED)


@pytest.mark.parametrize(
    "cfg",
    [LlamaConfig.tiny(), LlamaConfig.tiny(tie_embeddings=True, scan_layers=True, n_kv_heads=1)],
    ids=["tiny", "tiny-tied-scanned-mqa"],
)
def test_flops_per_token_is_three_forwards_of_the_jaxpr(cfg):
    assert cfg.flops_per_token() == 3 * _forward_matmul_flops(cfg) / cfg.seq_len - _masked_half(cfg)


@pytest.mark.timeout(300)
def test_flops_per_token_llama3_8b():
    cfg = LlamaConfig.llama3_8b(scan_layers=True)
    assert cfg.flops_per_token() == 3 * _forward_matmul_flops(cfg) / cfg.seq_len - _masked_half(cfg)
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.d_model - (2 * cfg.n_layers + 1) * cfg.d_model
    assert cfg.flops_per_token() == 6 * matmul_params + 6 * cfg.n_layers * cfg.d_model * cfg.seq_len


def test_flops_per_token_llama3_8b_is_6n_plus_the_causal_half_of_attention_by_hand():
    """Llama-3 8B at 8,192 tokens, from its published shape (d 4096, 32 layers, 32 query and 8 key/value heads of
    128, SwiGLU 14,336, vocabulary 128,256): N = the matmul weights a token runs through, the head's included (the
    embedding lookup is no matmul); attention's scores and weighted values are 12 L s d per token over the whole
    square, of which the causal half, 6 L s d, counts (MaxText's and Megatron-LM's convention)."""
    d, layers, kv, ffn, vocab, seq = 4096, 32, 8 * 128, 14336, 128256, 8192
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * ffn  # q, k and v, o, gate / up / down
    n = layers * per_layer + d * vocab
    assert n == 7_504_658_432
    assert LlamaConfig.llama3_8b().flops_per_token() == 6 * n + 6 * layers * seq * d == 45_027_950_592 + 6_442_450_944


@pytest.mark.slow  # 9 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_bfloat16_compute_gives_float32_logits_near_float32():
    cfg = LlamaConfig.tiny()
    ref = _random_model(cfg)
    low = Llama(LlamaConfig.tiny(dtype="bfloat16"), rngs=nnx.Rngs(5))
    _load(low, _params(ref))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(low, nnx.Param)))
    tokens = jax.random.randint(jax.random.key(0), (2, cfg.seq_len), 0, cfg.vocab_size)
    out = low(tokens)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(tokens)), atol=5e-2)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"n_heads": 8, "n_kv_heads": 16}, "n_kv_heads"),
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"n_heads": 3, "n_kv_heads": 1}, "n_heads"),
        ({"d_model": 72, "n_heads": 8, "n_kv_heads": 2}, "n_heads"),  # head width 9: odd
        ({"ffn": 0}, "ffn"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"seq_len": 16.0}, "seq_len"),
        ({"n_layers": True}, "n_layers"),
        ({"d_model": 0}, "d_model"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"norm_eps": -1e-6}, "norm_eps"),
        ({"dtype": "int32"}, "dtype"),
        ({"dtype": "not-a-dtype"}, "dtype"),
        ({"tie_embeddings": 1}, "tie_embeddings"),
        ({"scan_layers": "yes"}, "scan_layers"),
    ],
)
def test_bad_configs_raise_state_error_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"{field}=") as err:
        LlamaConfig.tiny(**overrides)
    assert isinstance(err.value, ValueError)


def test_all_problems_reported_at_once_and_long_sequences_refused():
    with pytest.raises(ConfigError) as err:
        LlamaConfig.tiny(ffn=0, norm_eps=0.0, n_kv_heads=3)
    assert all(f in str(err.value) for f in ("ffn=", "norm_eps=", "n_kv_heads="))
    model = Llama(LlamaConfig.tiny(seq_len=8), rngs=nnx.Rngs(0))
    with pytest.raises(StateError, match="seq_len=8"):
        model(jnp.zeros((1, 9), jnp.int32))
