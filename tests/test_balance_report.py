"""Visibility: a Trainer run of the balanced step on host-local data logs each step's assignment and measured device
speeds in metrics.jsonl, and `openhosti report` plots exactly those numbers."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import openhosti_jax as oh
from openhosti_jax.balance import HostLocalData, Throttle
from openhosti_jax.report.build import write_report
from openhosti_jax.report.figures import balance_figure, balance_records
from openhosti_jax.report.rundir import load_run


def loss_sum_fn(p, mb, rng):
    return jnp.sum((mb["x"] @ p["w"] - mb["y"]) ** 2), jnp.float32(mb["x"].shape[0])


def test_assignments_and_device_speeds_are_logged_and_plotted(tmp_path):
    mesh = oh.build_mesh(oh.MeshConfig(data=4), devices=jax.devices()[:4])
    r = np.random.default_rng(0)
    samples = {"x": r.normal(size=(256, 8)).astype(np.float32), "y": r.normal(size=(256, 2)).astype(np.float32)}
    state, plan = oh.create_train_state(lambda _: {"w": jnp.zeros((8, 2))}, optax.sgd(0.1), mesh, plan="dp")
    slow = Throttle.for_devices(4, {3: 5}, microbatch_seconds=0.005)  # device 3: 5x slower per microbatch
    step = oh.balanced_step(loss_sum_fn, mesh=mesh, plan=plan, microbatches=16, every=1, throttle=slow)
    data = HostLocalData(samples, 64, microbatches=16, seed=0)
    result = oh.Trainer(step, metrics_path=tmp_path / "metrics.jsonl", progress=False, log_every=1).fit(state, data, 5)

    logged = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["counts"] for m in logged] == [h["counts"] for h in result.history]
    assert logged[0]["counts"] == [4, 4, 4, 4] and all(sum(m["counts"]) == 16 for m in logged)
    nan = lambda xs: [np.nan if x is None else x for x in xs]  # None: not measured (zero work, retried)
    speeds = np.asarray(nan(logged[1]["device_speeds"]))  # after two probes
    assert speeds[3] < speeds[:3].min(), speeds  # the throttled device measured slowest
    assert logged[-1]["counts"][3] < 4

    report = write_report(tmp_path)
    assert "balance" in report.figures, report.skipped
    records = balance_records(load_run(tmp_path).metrics)
    counts_ax, speeds_ax = balance_figure(records).axes
    for d in range(4):
        assert [float(y) for y in counts_ax.lines[d].get_ydata()] == [m["counts"][d] for m in logged]
        np.testing.assert_allclose(speeds_ax.lines[d].get_ydata(), nan(m["device_speeds"][d] for m in logged))
