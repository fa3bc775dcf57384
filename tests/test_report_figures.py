"""Report figures: the plotted numbers are the recorded numbers; missing data skips a figure, never crashes."""

import json

import pytest

from openhosti_jax.pipeline import gpipe, simulate
from openhosti_jax.report import load_run, write_report
from openhosti_jax.report.figures import DPI, FIGSIZE, balance_figure, experts_figure, loss_figure, pipeline_figure
from openhosti_jax.report.rundir import append_jsonl, write_json

mpimg = pytest.importorskip("matplotlib.image")

METRICS = [{"step": s, "loss": 3.0 / s, "tokens_per_s": 100.0 + s, "step_time_s": 0.5 / s} for s in range(1, 7)]
BALANCE = [{"step": 1, "counts": [2, 2, 2, 2]}, {"step": 5, "counts": [3, 3, 1, 1]}]
MOE = [  # a mixture-of-experts step's metrics (openhosti_jax.models.moe.moe_metrics)
    {"moe_tokens/e0": 10 + s, "moe_tokens/e1": 10 - s, "moe_dropped_fraction": 0.05 * s, "moe_imbalance": 1 + s / 10}
    for s in range(1, 7)
]


def make_run(tmp_path, full: bool):
    for m, moe in zip(METRICS, MOE, strict=True):
        append_jsonl(tmp_path, "metrics.jsonl", {**m, **moe} if full else m)
    if full:
        write_json(tmp_path, "schedule.json", {"kind": "gpipe", "num_stages": 4, "num_microbatches": 6})
        for r in BALANCE:
            append_jsonl(tmp_path, "balance.jsonl", r)
        append_jsonl(tmp_path, "checkpoints.jsonl", {"step": 3, "blocking_s": 0.01})
        mem = {"params": 100, "grads": 100, "optimizer": 200, "activations": None}
        per_device = [{"device": d, "params": 100, "opt_state": 200} for d in range(4)]
        write_json(tmp_path, "plan.json", {"mesh": {"fsdp": 4}, "memory": {"predicted": mem, "per_device": per_device}})
    return tmp_path


def test_full_run_writes_every_figure_at_the_fixed_size(tmp_path):
    rep = write_report(make_run(tmp_path, full=True))
    assert sorted(rep.figures) == ["balance", "checkpoints", "experts", "loss", "memory", "pipeline", "throughput"]
    assert rep.skipped == {}
    for path in rep.figures.values():
        assert mpimg.imread(path).shape[:2] == (int(FIGSIZE[1] * DPI), int(FIGSIZE[0] * DPI))
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["summary"]["final_loss"] == METRICS[-1]["loss"]
    assert saved["summary"]["min_loss"] == min(m["loss"] for m in METRICS)
    later = sorted(m["tokens_per_s"] for m in METRICS[1:])
    assert saved["summary"]["median_tokens_per_s"] == (later[2] if len(later) % 2 else sum(later[1:3]) / 2)
    assert saved["summary"]["checkpoint_blocking_s_max"] == 0.01


def test_missing_data_is_skipped_with_a_note(tmp_path):
    rep = write_report(make_run(tmp_path, full=False), tmp_path / "out")
    assert sorted(rep.figures) == ["loss", "throughput"]
    assert set(rep.skipped) == {"memory", "pipeline", "balance", "checkpoints", "experts"}
    assert "balance.jsonl" in rep.skipped["balance"]


def test_plotted_data_equals_the_records(tmp_path):
    run = load_run(make_run(tmp_path, full=True))
    line = loss_figure(run.metrics).axes[0].lines[0]
    assert [float(x) for x in line.get_xdata()] == [m["step"] for m in METRICS]
    assert [float(y) for y in line.get_ydata()] == [m["loss"] for m in METRICS]
    lines = balance_figure(run.balance).axes[0].lines
    assert [[float(y) for y in ln.get_ydata()] for ln in lines] == [[2, 3], [2, 3], [2, 1], [2, 1]]
    shares, right = experts_figure(run.metrics).axes
    assert [[float(y) for y in ln.get_ydata()] for ln in shares.lines[:2]] == [
        [(10 + s) / 20 for s in range(1, 7)],
        [(10 - s) / 20 for s in range(1, 7)],
    ]
    assert [float(y) for y in right.lines[0].get_ydata()] == [m["moe_dropped_fraction"] for m in MOE]


def test_gantt_bubble_equals_gpipe_formula():
    s, m = 4, 6
    fig = pipeline_figure({"kind": "gpipe", "num_stages": s, "num_microbatches": m})
    assert f"bubble {(s - 1) / (m + s - 1):.1%}" in fig.axes[0].get_title()
    sim = simulate(gpipe(s, m), 1.0)
    busy = [p for p in fig.axes[0].patches if p.get_facecolor()[:3] != fig.axes[0].patches[0].get_facecolor()[:3]]
    assert len(busy) == 2 * s * m
    assert sum(p.get_width() for p in busy) == pytest.approx(sum(e - b for row in sim.timeline for _, b, e in row))


def test_missing_run_dir_is_a_typed_error(tmp_path):
    from openhosti_jax.errors import ReportError

    with pytest.raises(ReportError, match="metrics.jsonl"):
        load_run(tmp_path)
