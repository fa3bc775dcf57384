"""Models nobody here wrote: transformers' Flax BERT (dropout on), T5, ResNet (BatchNorm statistics updated) and
Llama, built from small configs (no download), each trained by its own step through ``@spmd`` and compared with the
same step under ``jax.jit`` on one device."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _harness import assert_close_trees, check_against_one_device
from flax.training import train_state

transformers = pytest.importorskip("transformers")


class State(train_state.TrainState):
    key: jax.Array


def fresh(tree):
    """A copy of a model's arrays: the @spmd step donates its state, and the model object keeps its own."""
    return jax.tree.map(jnp.array, tree)


def keyed_state(model):
    """A fresh `State` (a dropout key beside the parameters) for a transformers model, trained with Adam."""
    return State.create(apply_fn=model.__call__, params=fresh(model.params), tx=optax.adam(1e-3), key=jax.random.key(1))


def tokens(shape, vocab, seed=0):
    return np.random.default_rng(seed).integers(1, vocab, shape).astype(np.int32)


def bert():
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
        num_labels=3,
    )
    model = transformers.FlaxBertForSequenceClassification(config, seed=0)

    def make():
        return keyed_state(model)

    def step(state, batch):
        key = jax.random.fold_in(state.key, state.step)

        def loss_fn(p):
            logits = state.apply_fn(batch["ids"], params=p, dropout_rng=key, train=True).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    batch = {"ids": tokens((16, 16), 128), "label": np.arange(16, dtype=np.int32) % 3}
    return make, step, batch


def t5():
    import transformers.models.t5.modeling_flax_t5 as t5_module

    # transformers 4.46.3 calls jnp.clip(x, a_max=...), a keyword jax 0.10 removed: give that module a jnp that
    # still takes it (the model's math is unchanged)
    shim = types.SimpleNamespace(**{n: getattr(jnp, n) for n in dir(jnp) if not n.startswith("__")})
    shim.clip = lambda x, a_min=None, a_max=None: jnp.clip(x, min=a_min, max=a_max)
    t5_module.jnp = shim
    config = transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    model = transformers.FlaxT5ForConditionalGeneration(config, seed=0)

    def make():
        return keyed_state(model)

    def step(state, batch):
        key = jax.random.fold_in(state.key, state.step)

        def loss_fn(p):
            logits = state.apply_fn(
                batch["ids"], decoder_input_ids=batch["dec"], params=p, dropout_rng=key, train=True
            ).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    labels = tokens((16, 8), 128, seed=1)
    dec = np.concatenate([np.zeros((16, 1), np.int32), labels[:, :-1]], axis=1)
    return make, step, {"ids": tokens((16, 12), 128), "dec": dec, "labels": labels}


class ResNetState(train_state.TrainState):
    batch_stats: dict


def resnet():
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=4
    )
    model = transformers.FlaxResNetForImageClassification(config, seed=0)

    def make():
        return ResNetState.create(
            apply_fn=model.__call__,
            params=fresh(model.params["params"]),
            tx=optax.adam(1e-3),
            batch_stats=fresh(model.params["batch_stats"]),
        )

    def step(state, batch):
        def loss_fn(p):
            out, new = state.apply_fn(
                batch["pixels"], params={"params": p, "batch_stats": state.batch_stats}, train=True
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["label"]).mean()
            return loss, new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads).replace(batch_stats=stats), {"loss": loss}

    rng = np.random.default_rng(0)
    batch = {"pixels": rng.normal(size=(16, 3, 16, 16)).astype(np.float32), "label": np.arange(16, dtype=np.int32) % 4}
    return make, step, batch


def llama():
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.FlaxLlamaForCausalLM(config, seed=0)

    def make():
        return train_state.TrainState.create(apply_fn=model.__call__, params=fresh(model.params), tx=optax.adam(1e-3))

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn(batch["ids"], params=p).logits[:, :-1]
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return make, step, {"ids": tokens((16, 16), 128)}


MODELS = {"bert": bert, "t5": t5, "resnet": resnet, "llama": llama}


@pytest.mark.slow  # 140 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["auto", "fsdp"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformers_model_matches_one_device(name, plan):
    make, step, batch = MODELS[name]()
    ref, ours, _ = check_against_one_device(make, step, batch, plan)
    assert_close_trees(ref.params, ours.params, rtol=2e-3, atol=2e-4)
    if name == "resnet":
        assert_close_trees(ref.batch_stats, ours.batch_stats, rtol=2e-3, atol=2e-4)
        first = jax.tree.leaves(make().batch_stats)[0]
        assert not np.allclose(np.asarray(jax.tree.leaves(ours.batch_stats)[0]), np.asarray(first))
