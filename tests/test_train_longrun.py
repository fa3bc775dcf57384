"""Long-run behaviour of the Trainer: non-finite steps skipped, loss spikes rolled back, data positions kept, eval,
metrics fetched only at the logging interval, learning rate logged, TensorBoard / wandb / profiler output.

The references are independent: a run over the same data without the bad batches, plain jnp losses, optax's own
schedule, and TensorBoard event files decoded from their record format."""

import gzip
import os
import struct
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import openhosti_jax as oh
from openhosti_jax.data import ArrayDataset
from openhosti_jax.errors import BatchError, ConfigError, StateError
from openhosti_jax.microbatch import make_train_step
from openhosti_jax.train.profiling import ProfileWindow
from openhosti_jax.train.spikes import LossSpikePolicy
from openhosti_jax.train.writers import TensorBoardWriter, WandbWriter

D = 8


def _loss(params, batch, rng):
    pred = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    return jnp.sum((pred[:, 0] - batch["y"]) ** 2), batch["x"].shape[0]


def _setup(tx=None, plan="fsdp"):
    mesh = oh.build_mesh(oh.MeshConfig(data=2, fsdp=4))

    def init(rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (D, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 1)) * 0.3}

    state, plan = oh.create_train_state(init, tx or optax.adam(1e-2), mesh, plan=plan, seed=0)
    return state, oh.spmd(make_train_step(_loss), mesh=mesh, plan=plan)


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(16, D)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x.sum(1)).astype(np.float32)})
    return out


def _same_state(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_step_is_skipped_counted_and_leaves_the_run_as_if_the_batch_never_came(bad):
    data = _batches(8)
    poisoned = list(data)
    poisoned.insert(3, {"x": np.full_like(data[0]["x"], bad), "y": data[0]["y"]})
    state, step = _setup()
    result = oh.Trainer(step, progress=False, log_every=3).fit(state, poisoned, num_steps=8)
    ref_state, ref_step = _setup()
    reference = oh.Trainer(step=ref_step, progress=False).fit(ref_state, data, num_steps=8)
    assert result.skipped_nonfinite == 1 and int(result.state.step) == 8
    assert [r["skipped_nonfinite"] for r in result.history] == [0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert result.history[-1]["skipped_total"] == 1
    _same_state(result.state, reference.state)
    good = [r["loss"] for r in result.history if not r["skipped_nonfinite"]]
    assert good == [r["loss"] for r in reference.history]


def test_a_plain_params_opt_state_step_is_guarded_too():
    mesh = oh.build_mesh(oh.MeshConfig(data=-1))
    tx = optax.adam(1e-2)
    params = {"w1": jnp.ones((D, 16)) * 0.1, "w2": jnp.ones((16, 1)) * 0.1}

    @oh.spmd(mesh=mesh, plan="dp")
    def step(state, batch):
        p, opt = state
        loss, g = jax.value_and_grad(lambda q: _loss(q, batch, None)[0])(p)
        updates, opt = tx.update(g, opt, p)
        return (optax.apply_updates(p, updates), opt), {"loss": loss}

    state = (params, tx.init(params))
    before = jax.device_get(state)
    bad = {"x": np.full((16, D), np.nan, np.float32), "y": np.zeros(16, np.float32)}
    after, metrics = step(state, bad)
    assert int(metrics["skipped_nonfinite"]) == 1
    _same_state(jax.device_get(after), before)
    after, metrics = step(after, _batches(1)[0])
    assert int(metrics["skipped_nonfinite"]) == 0 and int(after[1][0].count) == 1


def test_the_guard_can_be_turned_off_and_then_nan_reaches_the_parameters():
    mesh = oh.build_mesh(oh.MeshConfig(data=-1))
    state, plan = oh.create_train_state(
        lambda r: {"w1": jnp.ones((D, 16)), "w2": jnp.ones((16, 1))}, optax.sgd(0.1), mesh
    )
    step = oh.spmd(make_train_step(_loss), mesh=mesh, plan=plan, skip_nonfinite=False)
    bad = {"x": np.full((16, D), np.nan, np.float32), "y": np.zeros(16, np.float32)}
    new, metrics = step(state, bad)
    assert "skipped_nonfinite" not in metrics and bool(jnp.isnan(new.params["w1"]).all())


def _spiky(n, at):
    data = _batches(n)
    spike = {"x": data[at]["x"], "y": data[at]["y"] * 0 + 300.0}
    return data, data[:at] + [spike] + data[at:]


def test_a_loss_spike_rolls_back_to_the_last_checkpoint_and_skips_the_batch(tmp_path):
    data, spiky = _spiky(14, 9)
    state, step = _setup(optax.sgd(0.02))
    ckpt = oh.TrainerCheckpoint(tmp_path / "ckpt", every_steps=4)
    policy = LossSpikePolicy(z=8.0, window=20, min_history=5)
    result = oh.Trainer(step, progress=False, log_every=3, checkpoint=ckpt, spikes=policy).fit(
        state, spiky, num_steps=14
    )
    ref_state, ref_step = _setup(optax.sgd(0.02))
    reference = oh.Trainer(ref_step, progress=False).fit(ref_state, data, num_steps=14)
    spikes = [e for e in result.events if e["event"] == "spike"]
    assert len(spikes) == 1 and spikes[0]["batch"] == 10 and spikes[0]["skipped_batches"] == [10]
    assert spikes[0]["rolled_back_to_step"] == 8
    _same_state(result.state, reference.state)
    assert [r["loss"] for r in result.history] == [r["loss"] for r in reference.history]


def test_spike_policy_needs_a_checkpoint_and_replayable_data(tmp_path):
    state, step = _setup()
    with pytest.raises(ConfigError, match="checkpoint"):
        oh.Trainer(step, spikes=LossSpikePolicy())
    trainer = oh.Trainer(
        step, progress=False, checkpoint=oh.TrainerCheckpoint(tmp_path / "c", every_steps=2), spikes=LossSpikePolicy()
    )
    with pytest.raises(StateError, match="one-shot"):
        trainer.fit(state, iter(_batches(4)), num_steps=4)
    with pytest.raises(ConfigError, match="min_history"):
        LossSpikePolicy(window=5, min_history=10)


@pytest.mark.slow  # 6 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_a_plain_generator_resumes_at_its_position_by_skipping(tmp_path):
    data = _batches(10)

    def fit(steps, with_ckpt=True):
        state, step = _setup()
        ckpt = oh.TrainerCheckpoint(tmp_path / "ckpt", every_steps=2) if with_ckpt else None
        return oh.Trainer(step, progress=False, checkpoint=ckpt).fit(state, (b for b in data), num_steps=steps)

    straight = fit(8, with_ckpt=False)
    with pytest.warns(UserWarning, match="skips that many batches"):
        first = fit(5)
    with pytest.warns(UserWarning, match="skips that many batches"):
        resumed = fit(8)
    assert [e["event"] for e in resumed.events] == ["resumed"] and resumed.events[0]["step"] == 5
    assert [r["loss"] for r in first.history + resumed.history] == [r["loss"] for r in straight.history]
    _same_state(resumed.state, straight.state)


def test_array_dataset_resumes_at_the_same_sample_with_another_batch_size_or_refuses():
    arrays = {"x": np.arange(48)}
    ds = ArrayDataset(arrays, global_batch_size=4, seed=3)
    for _ in range(3):
        next(ds)
    order = ds.epoch_order(0)
    six = ArrayDataset(arrays, global_batch_size=6, seed=3)
    six.set_state(ds.get_state())
    np.testing.assert_array_equal(next(six)["x"], arrays["x"][order[12:18]])
    five = ArrayDataset(arrays, global_batch_size=5, seed=3)
    with pytest.raises(BatchError, match="global_batch_size 4 at sample 12"):
        five.set_state(ds.get_state())


def test_eval_runs_under_the_plan_without_donation_and_equals_plain_jnp():
    train, held_out = _batches(6), _batches(3, seed=1)
    state, step = _setup()

    def eval_step(s, batch):
        loss_sum, n = _loss(s.params, batch, None)
        return {"loss": loss_sum / n}

    trainer = oh.Trainer(step, progress=False, eval_step=eval_step)
    result = trainer.fit(state, train, num_steps=6, eval_data=held_out, eval_every=3)
    assert [r["step"] for r in result.eval_history] == [3, 6]
    params = jax.device_get(result.state.params)
    expected = np.mean([float(_loss(params, b, None)[0]) / 16 for b in held_out])
    np.testing.assert_allclose(result.eval_history[-1]["eval_loss"], expected, rtol=1e-5)
    assert result.eval_history[-1]["eval_batches"] == 3
    with pytest.raises(StateError, match="one-shot"):
        trainer.fit(state, train, num_steps=6, eval_data=iter(held_out))
    with pytest.raises(ConfigError, match="eval_step"):
        oh.Trainer(step).fit(state, train, num_steps=1, eval_data=held_out)


def test_metrics_are_fetched_only_at_the_logging_interval(monkeypatch):
    state, step = _setup()
    step(state, _batches(1)[0])  # compile outside the count
    state, step = _setup()
    calls = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: calls.append(1) or real(x))
    result = oh.Trainer(step, progress=False, log_every=5).fit(state, _batches(10), num_steps=10)
    assert len(calls) == 2 and len(result.history) == 10
    assert result.history[0]["step_time_s"] == result.history[4]["step_time_s"]


def test_learning_rate_and_grad_norm_are_logged():
    schedule = optax.linear_schedule(1e-2, 1e-3, 10)
    state, step = _setup(optax.adam(schedule))
    result = oh.Trainer(step, progress=False, learning_rate=schedule).fit(state, _batches(5), num_steps=5)
    np.testing.assert_allclose([r["lr"] for r in result.history], [float(schedule(i)) for i in range(5)])
    assert all(r["grad_norm"] > 0 for r in result.history)
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
    state, step = _setup(injected)
    result = oh.Trainer(step, progress=False, log_every=5).fit(state, _batches(5), num_steps=5)
    np.testing.assert_allclose(result.history[-1]["lr"], float(schedule(4)), rtol=1e-6)


def _tfrecords(path):
    """(tag, step, value) of every scalar in a TensorBoard event file, read from its TFRecord framing."""
    from tensorboardX.proto import event_pb2

    out = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            event = event_pb2.Event.FromString(f.read(length))
            f.read(4)
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_wandb_and_profiler_receive_the_records(tmp_path, monkeypatch):
    logged = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: types.SimpleNamespace(
        log=lambda d, step: logged.append((step, d)), finish=lambda: logged.append("finish"), kw=kw
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    state, step = _setup()
    writers = [TensorBoardWriter(tmp_path / "tb"), WandbWriter(project="p", mode="offline")]
    window = ProfileWindow.parse("2:3", str(tmp_path / "profile"))
    result = oh.Trainer(step, progress=False, log_every=2, writers=writers, profile=window).fit(
        state, _batches(4), num_steps=4
    )
    (events,) = [f for f in os.listdir(tmp_path / "tb") if f.startswith("events")]
    scalars = _tfrecords(tmp_path / "tb" / events)
    losses = [(s, v) for tag, s, v in scalars if tag == "loss"]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in result.history]
    assert [s for s, _ in logged[:-1]] == [1, 2, 3, 4] and logged[-1] == "finish"
    assert logged[0][1]["loss"] == result.history[0]["loss"]
    traces = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "profile") for f in fs if f.endswith(".json.gz")]
    assert len(traces) == 1 and b"traceEvents" in gzip.open(traces[0]).read()
    with pytest.raises(ConfigError, match="FIRST:LAST"):
        ProfileWindow.parse("a:b", "x")


def test_a_finished_run_says_so_when_run_again(tmp_path):
    def fit():
        state, step = _setup()
        ckpt = oh.TrainerCheckpoint(tmp_path / "ckpt", every_steps=2)
        return oh.Trainer(step, progress=False, checkpoint=ckpt).fit(
            state, ArrayDataset({"x": np.ones((64, D), np.float32), "y": np.zeros(64, np.float32)}, 16), num_steps=4
        )

    first = fit()
    again = fit()
    assert first.events == [] and again.history == []
    assert again.events == [{"event": "resumed", "step": 4, "steps_left": 0}]
