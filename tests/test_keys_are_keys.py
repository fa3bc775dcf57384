"""PRNG keys are never batch data: typed keys, raw ``uint32[2]`` keys (``jax.random.PRNGKey``) and batches of keys,
in any argument, are replicated and never decide the batch size, by one rule (`openhosti_jax.sharding.batch`) used
in placement, the planner's traces and microbatching. Each step is checked against the same step under plain
``jax.jit`` on one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import openhosti_jax as oh
from openhosti_jax.errors import BatchError
from openhosti_jax.microbatch import accumulate_gradients, split_microbatches
from openhosti_jax.planner.workload import measure_step
from openhosti_jax.sharding.batch import batch_leaves, batch_size, check_batch, is_key, place_batch

KEY = jax.random.key(0)
KEY_FORMS = {
    "raw": lambda: jax.random.PRNGKey(0),
    "typed": lambda: jax.random.key(0),
    "raw_rbg": lambda: jax.random.key_data(jax.random.key(0, impl="rbg")),
}


def mesh():
    return oh.build_mesh(oh.MeshConfig(data=8))


def on_one_device(tree):
    return jax.device_put(tree, jax.devices()[0])


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(4)(x)


def linen_state():
    model = MLP()
    params = model.init(jax.random.PRNGKey(1), jnp.ones((1, 8)), train=False)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def train_step(state, batch, dropout_rng):
    """As flax's examples and the "Scale up Flax Modules" guide write it: the dropout key is its own argument."""
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"], train=True, rngs={"dropout": dropout_rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def data(rows=16):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(rows, 8)).astype(np.float32), "y": rng.integers(0, 4, rows).astype(np.int32)}


def run(step, state, batch, key, steps=2):
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch, key)
        losses.append(float(metrics["loss"]))
    return losses, state


def test_the_rule_reads_every_key_form_as_a_key_and_never_as_the_batch():
    batch = {"x": np.zeros((16, 3), np.float32), "rng": jax.random.PRNGKey(0), "keys": jax.random.split(KEY, 16)}
    batch["raw_keys"] = jax.random.split(jax.random.PRNGKey(0), 16)
    assert [is_key(KEY_FORMS[k]()) for k in KEY_FORMS] == [True, True, True]
    assert batch_size(batch) == 16 and batch_leaves(batch) == [False, False, False, True]  # keys, keys, raw keys, x
    assert not is_key(np.zeros((16, 2), np.int32)) and not is_key(np.zeros((16,), np.uint32))
    assert batch_size({"rng": jax.random.PRNGKey(0)}) is None
    placed = place_batch(batch, mesh(), jax.P("data"))
    assert placed["x"].sharding.spec == jax.P("data")
    assert all(placed[k].sharding.is_fully_replicated for k in ("rng", "keys", "raw_keys"))
    np.testing.assert_array_equal(jax.random.key_data(placed["keys"]), jax.random.key_data(batch["keys"]))


def test_a_mismatched_batch_of_a_state_batch_step_names_every_leaf_keys_aside():
    batch = {"x": np.zeros((16, 3)), "y": np.zeros(8), "rng": jax.random.PRNGKey(0)}
    with pytest.raises(BatchError, match=r"batch\['x'\]: 16, batch\['y'\]: 8; give every batch leaf shape"):
        check_batch(batch)
    assert check_batch({"x": np.zeros((16, 3)), "rng": jax.random.PRNGKey(0), "n": np.float32(1)}) == 16


@pytest.mark.parametrize("form", sorted(KEY_FORMS))
def test_the_planners_traces_size_the_batch_by_its_rows_never_by_a_key(form):
    """The planner's traces (batch 1 and 2) of ``train_step(state, batch, dropout_rng)``, as `AnyCalls` gives them
    the call's data: the key was read as a batch leaf (``found sizes [2, 16]``); now the batch is 16 rows and the
    key is the same key in both traces, in every form."""
    key = KEY_FORMS[form]()
    fn = train_step if form != "raw_rbg" else lambda s, b, k: train_step(s, b, jax.random.wrap_key_data(k, impl="rbg"))
    state = linen_state()
    work = measure_step(lambda s, d: fn(s, d["1"], d["2"]), state, {"1": data(), "2": key}, state.params)
    # per example: the forward's 2 (8x32 + 32x4), the weight gradients' as much, the hidden activation's 2 (32x4)
    assert work.global_batch == 16 and work.flops_per_example == 2 * 768 + 256


def test_flax_train_step_with_a_prngkey_argument_matches_jax_jit():
    """The same step under a named plan: the raw key replicated (split over 8 devices, its 2 words would not
    divide), the result jit's."""
    key = jax.random.PRNGKey(0)
    ref_losses, ref = run(jax.jit(train_step), on_one_device(linen_state()), on_one_device(data()), on_one_device(key))
    step = oh.spmd(mesh=mesh(), plan="dp")(train_step)
    losses, ours = run(step, linen_state(), data(), key)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # the automatic planner prices and compiles candidates: 10-20 s on the loaded 2-core machine
@pytest.mark.timeout(300)
def test_the_issues_flax_step_with_prngkey_runs_under_the_automatic_plan_and_matches_jax_jit():
    """The issue's reproduction exactly: ``oh.spmd(mesh=mesh)(train_step)`` (no plan named) with ``dropout_rng =
    jax.random.PRNGKey(0)`` raised ``BatchError ... found sizes [2, 16]`` on the first call."""
    key = jax.random.PRNGKey(0)
    ref_losses, ref = run(jax.jit(train_step), on_one_device(linen_state()), on_one_device(data()), on_one_device(key))
    step = oh.spmd(mesh=mesh())(train_step)
    losses, ours = run(step, linen_state(), data(), key)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert step.plan.data_parallel_size == 8


def test_a_batch_of_one_key_per_row_traces_at_any_batch_size_and_matches_jax_jit():
    """``split(key, batch)`` mapped over with the rows: the planner's traces at batch 1 and 2 resize it with the
    rows (else ``vmap`` would see 1 row and 16 keys); it is replicated, and the step equals jit's."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, keys):
        def loss(p):
            noise = jax.vmap(lambda k: jax.random.normal(k, (8,)))(keys)
            return jnp.mean(((x + 0.1 * noise) @ p["w"]) ** 2)

        value, g = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = {"w": jnp.full((8, 4), 0.1)}
    x, keys = data()["x"], jax.random.split(KEY, 16)
    ref = jax.jit(step)(*on_one_device((params, tx.init(params), x, keys)))
    spmd = oh.spmd(step, mesh=mesh(), plan="dp", params="0")
    ours = spmd(params, tx.init(params), x, keys)
    np.testing.assert_allclose(float(ours[2]), float(ref[2]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ours[0]["w"]), np.asarray(ref[0]["w"]), rtol=1e-5)


def test_microbatches_give_a_key_whole_and_cut_a_key_per_row_with_the_rows():
    """A key inside a ``make_train_step`` batch reaches every microbatch whole; one key per row follows its rows:
    the accumulated loss and gradient equal the whole batch's."""

    def loss_sum_fn(p, mb, rng):
        noise = jax.random.normal(mb["rng"], (8,)) + jax.vmap(lambda k: jax.random.normal(k, (8,)))(mb["keys"])
        return jnp.sum(((mb["x"] + 0.1 * noise) @ p["w"]) ** 2), mb["x"].shape[0]

    batch = {"x": data()["x"], "rng": jax.random.PRNGKey(3), "keys": jax.random.split(KEY, 16)}
    params = {"w": jnp.full((8, 4), 0.1)}
    whole, g_whole = jax.jit(jax.value_and_grad(lambda p, b: loss_sum_fn(p, b, None)[0] / 16))(params, batch)
    loss, grads, _ = jax.jit(lambda p, b: accumulate_gradients(loss_sum_fn, p, b, 4))(params, batch)
    np.testing.assert_allclose(float(loss), float(whole), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(g_whole["w"]), rtol=1e-5)
    stacked = jax.eval_shape(lambda b: split_microbatches(b, 4), batch)
    assert stacked["rng"].shape == (4, 2) and stacked["keys"].shape == (4, 4) and stacked["x"].shape == (4, 4, 8)
    padded = jax.eval_shape(lambda b: split_microbatches(b, 3), batch)  # 3 microbatches of 6: two padding rows
    assert padded["keys"].shape == (3, 6) and padded["mask"].shape == (3, 6)


def test_a_key_inside_a_state_batch_batch_is_replicated_and_matches_jax_jit():
    """``step(state, batch)`` whose batch dict carries the dropout key (``PRNGKey``: shape (2,), which split over 8
    devices would not divide): replicated, and the microbatched step (2 accumulation steps) equals jit's."""

    def loss_sum_fn(params, mb, rng):
        logits = MLP().apply({"params": params}, mb["x"], train=True, rngs={"dropout": mb["rng"]})
        return optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"]).sum(), mb["x"].shape[0]

    step = oh.make_train_step(loss_sum_fn)
    batch = {**data(), "rng": jax.random.PRNGKey(5)}
    ref_state, ref = jax.jit(oh.make_train_step(loss_sum_fn, num_microbatches=2))(
        *on_one_device((linen_state(), batch))
    )
    spmd = oh.spmd(step, mesh=mesh(), plan="dp", microbatch=2)
    state, metrics = spmd(linen_state(), batch)
    assert spmd.num_microbatches == 2
    np.testing.assert_allclose(float(metrics["loss"]), float(ref["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
