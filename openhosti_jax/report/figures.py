"""PNG figures from a run directory: loss, throughput, memory, pipeline Gantt, balancer, checkpoints, experts.

matplotlib is imported only here, lazily (``pip install openhosti_jax[viz]``). Each ``*_figure`` function
returns a `matplotlib.figure.Figure`, or raises `openhosti_jax.errors.MissingDataError` naming what the run did
not record.

Example:
    >>> from openhosti_jax.report.figures import loss_figure
    >>> fig = loss_figure([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    >>> [float(y) for y in fig.axes[0].lines[0].get_ydata()]
    [2.0, 1.5]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openhosti_jax.errors import ConfigError, MissingDataError
from openhosti_jax.models.moe import EXPERT_TOKENS
from openhosti_jax.pipeline import make_schedule, simulate

FIGSIZE = (8.0, 4.5)
"""Inches; at `DPI` every PNG is 800 x 450 pixels."""
DPI = 100


def new_figure(ncols: int = 1) -> Any:
    """A `Figure` of `FIGSIZE` at `DPI` with ``ncols`` axes (no pyplot, no display needed)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ConfigError(
            "openhosti report needs matplotlib, which is not installed; "
            "install it with `pip install openhosti_jax[viz]`"
        ) from e
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    fig.subplots(1, ncols)
    return fig


def _series(metrics: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), int | float)]
    if not rows:
        raise MissingDataError(f"no {key!r} values in metrics.jsonl ({len(metrics)} records)")
    return [r[0] for r in rows], [float(r[1]) for r in rows]


def loss_figure(metrics: Sequence[dict[str, Any]]) -> Any:
    """Training loss per step."""
    steps, loss = _series(metrics, "loss")
    fig = new_figure()
    ax = fig.axes[0]
    ax.plot(steps, loss, marker="." if len(steps) < 50 else None)
    ax.set(xlabel="step", ylabel="loss", title=f"loss {loss[0]:.4f} -> {loss[-1]:.4f}")
    ax.grid(alpha=0.3)
    return fig


def throughput_figure(metrics: Sequence[dict[str, Any]]) -> Any:
    """Tokens per second per step (the first step includes compilation)."""
    steps, tps = _series(metrics, "tokens_per_s")
    fig = new_figure()
    ax = fig.axes[0]
    ax.plot(steps, tps, marker="." if len(steps) < 50 else None, color="tab:green")
    ax.set(xlabel="step", ylabel="tokens / s", title="throughput (step 1 includes compilation)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    return fig


_PREDICTED = ("params", "grads", "optimizer", "activations")
_COMPILED = ("argument", "temp", "output")


def memory_figure(plan: dict[str, Any] | None) -> Any:
    """Left: params / optimizer bytes resident per device. Right: predicted vs compiled per-device bytes."""
    memory = (plan or {}).get("memory")
    if not memory or not memory.get("predicted"):
        raise MissingDataError("plan.json has no memory breakdown (the run did not record predicted memory)")
    mib = 2**20
    fig = new_figure(2)
    left, right = fig.axes
    rows = memory.get("per_device") or []
    if rows:
        ids = [str(r["device"]) for r in rows]
        p = [r["params"] / mib for r in rows]
        o = [r["opt_state"] / mib for r in rows]
        left.bar(ids, p, label="params")
        left.bar(ids, o, bottom=p, label="optimizer")
        pred = memory["predicted"]
        left.axhline((pred["params"] + pred["optimizer"]) / mib, color="k", ls="--", label="predicted")
        left.set(xlabel="device", ylabel="MiB", title="resident state per device")
        left.legend(fontsize=8)
    else:
        left.set_title("no per-device shard sizes recorded")
    bottom = 0.0
    for name in _PREDICTED:
        v = memory["predicted"].get(name)
        if v:
            right.bar("predicted", v / mib, bottom=bottom, label=name)
            bottom += v / mib
    comp = memory.get("compiled")
    if comp:
        bottom = 0.0
        for name in _COMPILED:
            v = comp[name] - (comp["alias"] if name == "output" else 0)
            if v > 0:
                right.bar("compiled", v / mib, bottom=bottom, label=f"compiled {name}", hatch="//", alpha=0.7)
                bottom += v / mib
        if comp.get("peak"):
            right.axhline(comp["peak"] / mib, color="r", ls=":", label="compiled peak")
    right.set(ylabel="MiB per device", title="predicted vs compiled" if comp else "predicted (not compiled)")
    right.legend(fontsize=7)
    return fig


def pipeline_figure(schedule: dict[str, Any] | None) -> Any:
    """Gantt chart of a simulated pipeline schedule; idle time (the bubble) shaded red."""
    if not schedule:
        raise MissingDataError("no schedule.json in the run and no --schedule given")
    sched = make_schedule(
        schedule.get("kind", "1f1b"),
        int(schedule["num_stages"]),
        int(schedule["num_microbatches"]),
        int(schedule.get("num_virtual", 1)),
    )
    sim = simulate(
        sched, schedule.get("forward_times", 1.0), schedule.get("backward_times"), schedule.get("comm_time", 0.0)
    )
    fig = new_figure()
    ax = fig.axes[0]
    for d, row in enumerate(sim.timeline):
        ax.barh(d, sim.makespan, left=0.0, height=0.8, color="tab:red", alpha=0.25)
        for action, start, end in row:
            color = "tab:blue" if action.kind == "F" else "tab:green"
            ax.barh(d, end - start, left=start, height=0.8, color=color, edgecolor="white")
            if sched.num_stages * sched.num_microbatches <= 64:
                ax.text((start + end) / 2, d, str(action), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(sched.num_stages), [f"stage {d}" for d in range(sched.num_stages)])
    ax.invert_yaxis()
    ax.set(
        xlabel="time (units of one forward)",
        title=f"{sched.name} S={sched.num_stages} M={sched.num_microbatches}: bubble {sim.bubble_fraction:.1%} (red)",
    )
    return fig


def balance_records(metrics: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The balanced step's per-step ``counts`` and ``device_speeds`` as the Trainer logged them in metrics.jsonl."""
    return [
        {"step": m["step"], "counts": m["counts"], "device_speeds": m.get("device_speeds")}
        for m in metrics
        if isinstance(m.get("counts"), list) and "step" in m
    ]


def balance_figure(balance: Sequence[dict[str, Any]]) -> Any:
    """Microbatches assigned to each device over the steps the balancer recorded, and (when recorded) each
    device's measured speed in microbatches per second."""
    if not balance:
        raise MissingDataError("no balancer assignments in the run (no balance.jsonl, no 'counts' in metrics.jsonl)")
    steps = [r["step"] for r in balance]
    counts = [r["counts"] for r in balance]
    speeds = [r.get("device_speeds") for r in balance]
    has_speeds = any(isinstance(s, list) for s in speeds)
    fig = new_figure(2 if has_speeds else 1)
    ax = fig.axes[0]
    for d in range(len(counts[0])):
        ax.step(steps, [c[d] for c in counts], where="post", label=f"device {d}")
    ax.set(xlabel="step", ylabel="microbatches", title="balancer assignment per device")
    ax.legend(fontsize=7, ncols=2)
    ax.grid(alpha=0.3)
    if has_speeds:
        ax = fig.axes[1]
        for d in range(len(counts[0])):
            ys = [s[d] if isinstance(s, list) and s[d] is not None else float("nan") for s in speeds]
            ax.plot(steps, ys, marker="." if len(steps) < 50 else None, label=f"device {d}")
        ax.set(xlabel="step", ylabel="microbatches / s", title="measured device speed")
        ax.grid(alpha=0.3)
    return fig


def checkpoint_figure(checkpoints: Sequence[dict[str, Any]]) -> Any:
    """Time the training loop was blocked by each checkpoint call."""
    if not checkpoints:
        raise MissingDataError("no checkpoints.jsonl in the run (no --checkpoint-dir)")
    fig = new_figure()
    ax = fig.axes[0]
    ax.bar([r["step"] for r in checkpoints], [1e3 * r["blocking_s"] for r in checkpoints], color="tab:purple")
    ax.set(xlabel="step", ylabel="ms blocked", title="checkpoint save time seen by the training loop")
    return fig


def experts_figure(metrics: Sequence[dict[str, Any]]) -> Any:
    """A mixture-of-experts run's routing per step (`openhosti_jax.models.moe.moe_metrics`): each expert's share
    of the routed tokens (left; ``1 / experts`` when balanced), and the dropped fraction and the worst layer's
    most-loaded expert over the mean (right).

    >>> recs = [{"step": s, "moe_tokens/e0": 3 * s, "moe_tokens/e1": s, "moe_dropped_fraction": 0.1 / s,
    ...          "moe_imbalance": 1.5} for s in (1, 2)]
    >>> fig = experts_figure(recs)
    >>> [float(y) for y in fig.axes[0].lines[0].get_ydata()], [float(y) for y in fig.axes[1].lines[0].get_ydata()]
    ([0.75, 0.75], [0.1, 0.05])
    """
    keys = sorted(
        {k for m in metrics for k in m if k.startswith(EXPERT_TOKENS)}, key=lambda k: int(k[len(EXPERT_TOKENS) :])
    )
    if not keys:
        raise MissingDataError(f"no {EXPERT_TOKENS}* values in metrics.jsonl (not a mixture-of-experts run)")
    rows = [m for m in metrics if all(isinstance(m.get(k), int | float) for k in keys)]
    steps = [m["step"] for m in rows]
    totals = [sum(m[k] for k in keys) or 1 for m in rows]
    fig = new_figure(2)
    left, right = fig.axes
    marker = "." if len(steps) < 50 else None
    for k in keys:
        left.plot(
            steps,
            [m[k] / t for m, t in zip(rows, totals, strict=True)],
            marker=marker,
            label=k[len(EXPERT_TOKENS) - 1 :],
        )
    left.axhline(1 / len(keys), color="grey", linestyle=":", linewidth=1)
    left.set(xlabel="step", ylabel="share of routed tokens", title=f"tokens per expert ({len(keys)} experts)")
    if len(keys) <= 16:
        left.legend(fontsize=7, ncols=2)
    for key, label, color in (
        ("moe_dropped_fraction", "dropped fraction", "tab:red"),
        ("moe_imbalance", "max / mean expert load", "tab:blue"),
    ):
        pts = [(m["step"], float(m[key])) for m in metrics if isinstance(m.get(key), int | float)]
        if pts:
            right.plot(*zip(*pts, strict=True), marker=marker, color=color, label=label)
    right.set(xlabel="step", title="dropped tokens and load imbalance")
    right.legend(fontsize=7)
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    return fig
