"""The BERT encoder against independent references: transformers' torch ``BertForSequenceClassification`` with the
same weights, plain ``jax.jit`` on one device against the same steps sharded over fsdp x tensor, the scanned stack
against the list of blocks, the released BERT-Large's parameter count, the jaxpr FLOP counter."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from openhosti_jax.errors import BatchError, ConfigError
from openhosti_jax.flops import jaxpr_flops
from openhosti_jax.models.bert import Bert, BertConfig, classification_loss
from openhosti_jax.sharding.rules import LAYER_AXIS, logical_names

BERT_LARGE_RELEASED = 335_141_888
"""bert-large-uncased's encoder, embeddings and pooler (the sum of its checkpoint's shapes, vocabulary 30522)."""


def _params(model: Bert) -> dict[str, Any]:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _load(model: Bert, pure: dict[str, Any]) -> None:
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def _stack(pure_list: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The list model's parameters laid out for the scanned model."""
    layers = [pure_list["blocks"][i] for i in range(n_layers)]
    return {**pure_list, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def _random_model(cfg: BertConfig, seed: int = 0) -> Bert:
    """A model whose biases and norms are random too (zeros and ones would hide a misplaced one) and whose kernels
    are 5x the init (std 0.1, so attention is far from uniform and the query and key weights matter)."""
    model = Bert(cfg, rngs=nnx.Rngs(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))

    def jitter(path: tuple[Any, ...], a: jax.Array) -> jax.Array:
        name = getattr(path[-1], "key", None)
        if name in ("bias", "scale"):
            return a + 0.1 * jax.random.normal(next(keys), a.shape)
        return 5.0 * a if name == "kernel" else a

    _load(model, jax.tree_util.tree_map_with_path(jitter, _params(model)))
    return model


def _batch(cfg: BertConfig, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Tokens, two segments, right padding of a different length per row (one row unpadded), labels."""
    rs = np.random.default_rng(seed)
    s = cfg.seq_len
    lengths = np.concatenate([[s], rs.integers(3, s, rows - 1)])
    mask = (np.arange(s)[None, :] < lengths[:, None]).astype(np.int32)
    split = rs.integers(1, lengths)  # segment B from here on
    return {
        "tokens": (rs.integers(1, cfg.vocab_size, (rows, s)) * mask).astype(np.int32),
        "token_types": ((np.arange(s)[None, :] >= split[:, None]) * mask).astype(np.int32),
        "attention_mask": mask,
        "labels": rs.integers(0, cfg.n_classes, rows).astype(np.int32),
    }


def _torch_reference(cfg: BertConfig, seed: int = 0) -> Any:
    """transformers' BertForSequenceClassification of ``cfg``'s shapes, every weight, bias and norm random."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.ffn,
        max_position_embeddings=cfg.seq_len,
        type_vocab_size=cfg.type_vocab_size,
        num_labels=cfg.n_classes,
        layer_norm_eps=cfg.norm_eps,
        hidden_act="gelu",
        attn_implementation="eager",
    )
    model = transformers.BertForSequenceClassification(hf_cfg).eval()
    with torch.no_grad():  # the init's zero biases and unit norms would hide a misplaced or missing one
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _from_torch(reference: Any, cfg: BertConfig) -> dict[str, Any]:
    """Our list model's parameters from the torch model's (a Linear's ``(out, in)`` weight is our kernel
    transposed); every torch parameter is used exactly once."""
    sd = {k: v.detach().numpy() for k, v in reference.named_parameters()}
    used: set[str] = set()

    def take(name: str, transpose: bool = False) -> np.ndarray:
        used.add(name)
        return sd[name].T if transpose else sd[name]

    def dense(prefix: str) -> dict[str, np.ndarray]:
        return {"kernel": take(f"{prefix}.weight", True), "bias": take(f"{prefix}.bias")}

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {"scale": take(f"{prefix}.weight"), "bias": take(f"{prefix}.bias")}

    e = "bert.embeddings"
    blocks = {}
    for i in range(cfg.n_layers):
        p = f"bert.encoder.layer.{i}"
        blocks[i] = {
            "wq": dense(f"{p}.attention.self.query"),
            "wk": dense(f"{p}.attention.self.key"),
            "wv": dense(f"{p}.attention.self.value"),
            "wo": dense(f"{p}.attention.output.dense"),
            "attn_norm": norm(f"{p}.attention.output.LayerNorm"),
            "up": dense(f"{p}.intermediate.dense"),
            "down": dense(f"{p}.output.dense"),
            "mlp_norm": norm(f"{p}.output.LayerNorm"),
        }
    pure = {
        "word": {"embedding": take(f"{e}.word_embeddings.weight")},
        "position": {"embedding": take(f"{e}.position_embeddings.weight")},
        "token_type": {"embedding": take(f"{e}.token_type_embeddings.weight")},
        "embed_norm": norm(f"{e}.LayerNorm"),
        "blocks": blocks,
        "pooler": dense("bert.pooler.dense"),
        "classifier": dense("classifier"),
    }
    assert used == set(sd), f"torch parameters not mapped: {sorted(set(sd) - used)}"
    return jax.tree.map(jnp.asarray, pure)


@pytest.mark.torch
@pytest.mark.slow  # imports torch and transformers: 20-50 s on the loaded 2-core machine
@pytest.mark.timeout(300)
def test_logits_match_transformers_bert_for_sequence_classification():
    import torch

    cfg = BertConfig.tiny(n_layers=3, n_classes=3)
    reference = _torch_reference(cfg)
    pure = _from_torch(reference, cfg)
    listed = Bert(cfg, rngs=nnx.Rngs(1))
    _load(listed, pure)
    scanned = Bert(BertConfig.tiny(n_layers=3, n_classes=3, scan_layers=True, attention_block=8), rngs=nnx.Rngs(2))
    _load(scanned, _stack(pure, cfg.n_layers))
    batch = _batch(cfg, 5)
    with torch.no_grad():
        ref = reference(
            input_ids=torch.from_numpy(batch["tokens"]).long(),
            token_type_ids=torch.from_numpy(batch["token_types"]).long(),
            attention_mask=torch.from_numpy(batch["attention_mask"]).long(),
        ).logits.numpy()
        ref_plain = reference(input_ids=torch.from_numpy(batch["tokens"][:, :16]).long()).logits.numpy()
    assert np.abs(ref).max() > 0.1 and np.abs(ref[1:] - ref[0]).max() > 1e-2  # rows differ: not a constant output
    for model in (listed, scanned):
        ours = model(jnp.asarray(batch["tokens"]), jnp.asarray(batch["token_types"]), batch["attention_mask"])
        assert ours.dtype == jnp.float32 and ours.shape == (5, 3)
        np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(model(batch)), ref, atol=1e-5, rtol=1e-5)  # the batch mapping
        # no mask and no token types: every token real, one segment; a shorter sequence uses the first positions
        np.testing.assert_allclose(np.asarray(model(batch["tokens"][:, :16])), ref_plain, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_padding_is_invisible_and_the_mask_matters():
    cfg = BertConfig.tiny()
    model = nnx.jit(lambda m, b: m(b))
    bert = Bert(cfg, rngs=nnx.Rngs(0))
    batch = _batch(cfg, 4, seed=3)
    mask = batch["attention_mask"]
    logits = model(bert, batch)
    other = {**batch, "tokens": np.where(mask == 1, batch["tokens"], 7).astype(np.int32)}  # new pad token ids
    np.testing.assert_allclose(np.asarray(model(bert, other)), np.asarray(logits), atol=1e-6)
    unmasked = np.asarray(model(bert, {k: v for k, v in other.items() if k != "attention_mask"}))
    assert np.abs(unmasked[1:] - np.asarray(logits)[1:]).min() > 1e-5  # every padded row changes without the mask
    np.testing.assert_allclose(unmasked[0], np.asarray(logits)[0], atol=1e-6)  # row 0 has no padding


@pytest.mark.slow  # builds two models eagerly, four compiles: 70-85 s on the loaded 2-core machine
@pytest.mark.timeout(300)
def test_scanned_equals_list_logits_and_grads_with_dropout():
    cfg = BertConfig.tiny(n_layers=3)
    listed = _random_model(cfg)
    scanned = Bert(BertConfig.tiny(n_layers=3, scan_layers=True, attention_block=8), rngs=nnx.Rngs(1))
    _load(scanned, _stack(_params(listed), cfg.n_layers))
    batch = jax.tree.map(jnp.asarray, _batch(cfg, 4, seed=1))
    key = jax.random.key(5)
    forward = nnx.jit(lambda m, rng: m(batch, rng=rng))
    for rng in (None, key):
        np.testing.assert_allclose(
            np.asarray(forward(scanned, rng)), np.asarray(forward(listed, rng)), atol=1e-5, rtol=1e-5
        )
    assert np.abs(np.asarray(forward(listed, key)) - np.asarray(forward(listed, None))).max() > 1e-4  # dropout ran

    def grads(model: Bert) -> dict[str, Any]:
        graphdef, state = nnx.split(model)
        loss = lambda st: classification_loss(nnx.merge(graphdef, st)(batch, rng=key), batch["labels"])  # noqa: E731
        return nnx.to_pure_dict(jax.jit(jax.grad(loss))(state))

    g_scan, expected = grads(scanned), _stack(grads(listed), cfg.n_layers)
    assert jax.tree.structure(expected) == jax.tree.structure(g_scan)
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    # every leaf gets a gradient but the key bias, which shifts a query's scores all alike: softmax ignores it
    assert float(jnp.max(jnp.abs(g_scan["blocks"]["wk"]["bias"]))) < 1e-6
    del g_scan["blocks"]["wk"]["bias"]
    assert min(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_scan)) > 1e-3


def _grad_probes(grads: Any) -> dict[str, jax.Array]:
    """One scalar per gradient leaf, its dot product with a fixed dense pattern (metrics must be scalars): two
    gradients that differ anywhere give different probes."""
    pure = nnx.to_pure_dict(grads) if isinstance(grads, nnx.State) else grads
    return {
        "grad" + jax.tree_util.keystr(path): jnp.sum(g * jnp.cos(0.7 * jnp.arange(g.size).reshape(g.shape) + 1.0))
        for path, g in jax.tree_util.tree_leaves_with_path(pure)
    }


def _bert_step(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, dict[str, Any]]:
    def loss(p: Any) -> jax.Array:
        return classification_loss(state.apply_fn(p, batch, model_state=state.model_state), batch["labels"])

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value, **_grad_probes(grads)}


@pytest.mark.slow  # compiles for 8 CPU devices: 35-60 s on the loaded 2-core machine
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("scan", "remat", "sequence"), [(False, "none", False), (True, "selective", True)], ids=["list", "scanned"]
)
def test_three_adam_steps_over_fsdp_and_tensor_equal_one_device(scan, remat, sequence):
    """fsdp=2 x tensor=4, ZeRO-3, the heads, MLP and vocabulary split over tensor by their logical names (the
    scanned model also under remat "selective" and the sequence split between blocks), against plain ``jax.jit``
    of the same step on one device: the loss, the gradients and the parameters after each of 3 Adam steps."""
    from openhosti_jax.mesh import MeshConfig, build_mesh
    from openhosti_jax.planner import PROFILES
    from openhosti_jax.planner.predict import parse_mesh
    from openhosti_jax.planner.search import Candidate, score
    from openhosti_jax.planner.workload import workload
    from openhosti_jax.train import create_train_state, spmd

    cfg = BertConfig.tiny(dropout=0.0, scan_layers=scan, attention_block=8 if scan else None)
    init = lambda r: Bert(cfg, rngs=nnx.Rngs(r))  # noqa: E731
    tx = optax.adam(3e-3)
    sizes = parse_mesh("fsdp=2,tensor=4")
    candidate = Candidate(sizes, 3, remat=remat, sequence_parallel=sequence)
    plan = score(workload(init, cfg.sample_batch(8)), tx, candidate, PROFILES["H100"]).plan
    blocks = plan.param_specs["blocks"] if scan else plan.param_specs["blocks"][0]

    def axes(spec: Any, dim: int) -> set[str]:
        entry = tuple(spec.get_value())[dim]
        return set(entry) if isinstance(entry, tuple) else {entry}

    for name in ("wq", "wk", "wv", "up"):
        assert "tensor" in axes(blocks[name]["kernel"], -1), name
    assert "tensor" in axes(blocks["down"]["kernel"], -2) and "tensor" in axes(plan.param_specs["word"]["embedding"], 0)
    mesh = build_mesh(MeshConfig.from_sizes(sizes))
    state, plan = create_train_state(init, tx, mesh, plan=plan, seed=0)
    assert "tensor" in str(jax.tree.leaves(state.params["word"])[0].sharding.spec)  # placed as planned
    step = spmd(_bert_step, mesh=mesh, plan=plan)

    graphdef, params = nnx.split(init(jax.random.key(0)), nnx.Param)

    def pure(tree: Any) -> Any:
        tree = jax.device_get(tree)
        return jax.tree.map(np.asarray, nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree)

    nnx.replace_by_pure_dict(params, pure(state.params))  # the reference starts from the sharded initial weights

    @jax.jit
    def plain(p: Any, opt: Any, batch: dict[str, jax.Array]) -> Any:
        def loss(q: Any) -> jax.Array:
            return classification_loss(nnx.merge(graphdef, q)(batch), batch["labels"])

        value, g = jax.value_and_grad(loss)(p)
        updates, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt, value, _grad_probes(g)

    p1, opt = jax.device_put((params, tx.init(params)), jax.devices()[0])
    for i in range(3):
        batch = _batch(cfg, 8, seed=10 + i)
        state, metrics = step(state, batch)
        p1, opt, loss1, g1 = plain(p1, opt, jax.tree.map(jnp.asarray, batch))
        assert float(metrics["loss"]) == pytest.approx(float(loss1), abs=1e-5)
        assert len(g1) == len(jax.tree.leaves(params)) and max(abs(float(v)) for v in g1.values()) > 1e-2
        for name, want in g1.items():
            assert float(metrics[name]) == pytest.approx(float(want), abs=1e-5, rel=1e-5), (i, name)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), pure(state.params), pure(p1))


def test_large_has_bert_large_parameters_and_shapes():
    cfg = BertConfig.large()
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.ffn, cfg.seq_len) == (24, 1024, 16, 4096, 512)
    assert cfg.vocab_size == 30592 == -(-30522 // 128) * 128 and cfg.norm_eps == 1e-12
    abstract = nnx.eval_shape(lambda: Bert(BertConfig.large(scan_layers=True), rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert count == cfg.num_params()
    head = cfg.d_model * cfg.n_classes + cfg.n_classes
    assert count == BERT_LARGE_RELEASED + (30592 - 30522) * cfg.d_model + head
    assert count == pytest.approx(BERT_LARGE_RELEASED, rel=0.01)
    names = logical_names(params)
    assert sum(n is not None and n[0] == LAYER_AXIS for n in names) == 16  # every block parameter is stacked
    assert all(n is not None for n in names)  # every dim named


@pytest.mark.parametrize("scan", [False, True])
def test_num_params_counts_the_real_tiny_model(scan):
    cfg = BertConfig.tiny(scan_layers=scan, n_classes=5, type_vocab_size=3)
    model = Bert(cfg, rngs=nnx.Rngs(0))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == cfg.num_params()


@pytest.mark.timeout(120)
def test_the_big_matrices_split_over_tensor():
    from openhosti_jax.sharding.tensor import base_specs

    abstract = nnx.eval_shape(lambda: Bert(BertConfig.large(scan_layers=True), rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    specs = base_specs(params, {"stage": 1, "data": 1, "fsdp": 2, "tensor": 8})
    by_path = {
        jax.tree_util.keystr(path): tuple(spec)
        for (path, _), spec in zip(jax.tree_util.tree_leaves_with_path(params), specs, strict=True)
    }
    expected = {
        "wq": (None, None, "tensor"),
        "wk": (None, None, "tensor"),
        "wv": (None, None, "tensor"),
        "wo": (None, "tensor", None),
        "up": (None, None, "tensor"),
        "down": (None, "tensor", None),
    }
    for name, spec in expected.items():
        assert by_path[f"['blocks']['{name}']['kernel'].value"] == spec, name
    assert by_path["['word']['embedding'].value"] == ("tensor", None)
    big = [x for x in jax.tree.leaves(params) if x.size >= 2**20]
    split = [s for x, s in zip(jax.tree.leaves(params), specs, strict=True) if x.size >= 2**20 and "tensor" in s]
    assert len(big) == len(split) + 1  # all but the pooler (1024 x 1024, once)


@pytest.mark.timeout(120)
def test_the_tensor_split_carries_through_every_block():
    """The planner's propagation follows a split through the whole block (exact GELU's ``erfc`` included): over
    tensor=4 nothing is gathered back but the vocabulary-split embedding table its lookup reads."""
    from openhosti_jax.models.presets import model_preset
    from openhosti_jax.planner.workload import workload
    from openhosti_jax.sharding.tensor import base_specs

    p = model_preset("bert-large", n_layers=3)
    w = workload(p.init, p.sample_batch(8))
    specs = base_specs(w.params, {"stage": 1, "data": 1, "fsdp": 1, "tensor": 4})
    dims = tuple(next((i for i, a in enumerate(tuple(s)) if a == "tensor"), None) for s in specs)
    split = w.tensor_split(dims, 4)
    assert split.cut_reshapes == 0 and split.split_share > 0.999
    assert split.resharded == 30592 * 1024 * 4


def _forward_matmul_flops(cfg: BertConfig) -> float:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Bert(cfg, rngs=nnx.Rngs(0))))
    batch = cfg.sample_batch(1)
    return jaxpr_flops(lambda st, b: nnx.merge(graphdef, st)(b), state, batch, matmul_only=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "cfg",
    [BertConfig.tiny(n_classes=3), BertConfig.large(scan_layers=True, attention_block=128)],
    ids=["tiny", "large"],
)
def test_flops_per_token_is_three_forwards_of_the_jaxpr(cfg):
    assert cfg.flops_per_token() == pytest.approx(3 * _forward_matmul_flops(cfg) / cfg.seq_len, rel=1e-12)


@pytest.mark.timeout(120)
def test_the_preset_plans_and_predicts_per_token():
    from openhosti_jax.models.presets import model_preset
    from openhosti_jax.planner.predict import predict
    from openhosti_jax.planner.workload import workload

    p = model_preset("bert-large")
    assert p.family is Bert and p.config.scan_layers and p.tokens_per_example == 512
    batch = p.sample_batch(8)
    assert batch["tokens"].shape == (8, 512) and batch["labels"].shape == (8,)
    w = workload(p.init, batch)
    assert w.tokens_per_example == 512  # the encoder's positions, not the classifier output's
    assert w.flops_per_example == pytest.approx(512 * p.flops_per_token, rel=1e-9)
    full, none = w.policy_activations("full", "bf16"), w.policy_activations("none", "bf16")
    # remat full keeps each block's input: 24 x 512 x 1024 bf16, and the mask and the logits' loss copies
    assert full.checkpointed_per_example == pytest.approx(24 * 512 * 1024 * 2, rel=0.2)
    assert full.bytes_per_example < none.bytes_per_example / 4
    pred = predict(p.init, optax.adamw(1e-4), p.sample_batch(32), "4xH100", model_flops_per_token=p.flops_per_token)
    assert pred.fits and pred.tokens_per_step == 32 * 512 and 0.05 < pred.mfu < 1


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n_heads": 5}, "n_heads"),  # 5 does not divide 32
        ({"d_model": 30, "n_heads": 4}, "n_heads"),
        ({"ffn": 0}, "ffn"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"seq_len": 16.0}, "seq_len"),
        ({"n_classes": 0}, "n_classes"),
        ({"type_vocab_size": True}, "type_vocab_size"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"dtype": "int32"}, "dtype"),
        ({"scan_layers": 1}, "scan_layers"),
        ({"attention_block": 0}, "attention_block"),
    ],
)
def test_bad_configs_raise_config_error_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"{field}=") as err:
        BertConfig.tiny(**overrides)
    assert isinstance(err.value, ValueError)


def test_bad_batches_raise_batch_error():
    model = Bert(BertConfig.tiny(seq_len=8), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(BatchError, match="seq_len=8"):
        model(jnp.zeros((2, 9), jnp.int32))
    with pytest.raises(BatchError, match="attention_mask"):
        model(tokens, attention_mask=jnp.ones((2, 7)))
    with pytest.raises(BatchError, match="token_types"):
        model(tokens, token_types=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(BatchError, match="'mask'"):
        model({"tokens": tokens, "mask": tokens})
    with pytest.raises(BatchError, match="not both"):
        model({"tokens": tokens}, attention_mask=tokens)
    with pytest.raises(BatchError, match=r"\(batch, seq\)"):
        model(jnp.zeros((8,), jnp.int32))
