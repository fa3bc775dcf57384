"""`predict`: what a training run would do on a cluster that is not attached, from abstract shapes alone: the step
time, tokens/s per device, model FLOPs utilisation and memory per device of the planner's choice or of a fixed
configuration. What ``openhosti predict`` prints before a cluster is rented.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> p = predict(nnx.Linear(1024, 1024, rngs=nnx.Rngs(0)), optax.adam(1e-3),
    ...             jax.ShapeDtypeStruct((64, 1024), jnp.float32), "8xH100")
    >>> p.devices, p.fits, 0 < p.mfu < 1
    (8, True, True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import optax

from openhosti_jax.errors import PlanningError
from openhosti_jax.mesh.config import AXES
from openhosti_jax.planner.choose import choose_plan
from openhosti_jax.planner.cluster import Cluster, cluster
from openhosti_jax.planner.search import Candidate, hybrid_axes, replicas, score
from openhosti_jax.planner.stacks import STACKS
from openhosti_jax.planner.workload import workload
from openhosti_jax.sharding.plan import ShardingPlan

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A plan and what the cost model predicts it does on ``cluster``."""

    plan: ShardingPlan
    cluster: Cluster
    step_seconds: float
    """Predicted seconds per optimizer step."""
    tokens_per_step: int
    """Tokens (or examples, for a model without a sequence) in one global batch."""
    model_flops_per_token: float
    """Training FLOPs per token the utilisation counts (the model's own formula, else the traced matmuls)."""
    memory_bytes: float
    """Predicted bytes per device."""
    memory_budget: int | None
    time: Mapping[str, float]
    """Seconds per step by part (compute, memory, collectives, ...)."""
    memory: Mapping[str, float]
    """Bytes per device by part (state, batch, temporaries)."""

    @property
    def devices(self) -> int:
        """Devices the plan spans."""
        return self.cluster.n_devices

    @property
    def tokens_per_second_per_device(self) -> float:
        """Throughput per device."""
        return self.tokens_per_step / self.step_seconds / self.devices

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second per device over the device's peak."""
        return self.tokens_per_second_per_device * self.model_flops_per_token / self.cluster.profile.peak_flops

    @property
    def fits(self) -> bool:
        """Whether the predicted memory is within the budget (no budget: True)."""
        return self.memory_budget is None or self.memory_bytes <= self.memory_budget

    def as_dict(self) -> dict[str, Any]:
        """The prediction as JSON-ready data."""
        p = self.plan
        return {
            "cluster": f"{self.cluster.hosts}x{self.cluster.devices_per_host}x{self.cluster.profile.name}",
            "stack": self.cluster.stack.name,
            "mesh": {a: int(n) for a, n in p.mesh_shape.items()},
            "zero": p.zero_stage,
            "remat": p.remat,
            "precision": p.precision,
            "microbatches": p.num_microbatches,
            "virtual": p.pipeline_virtual,
            "sequence_parallel": p.sequence_parallel,
            "step_seconds": self.step_seconds,
            "tokens_per_second_per_device": self.tokens_per_second_per_device,
            "mfu": self.mfu,
            "memory_gib": self.memory_bytes / GiB,
            "memory_budget_gib": None if self.memory_budget is None else self.memory_budget / GiB,
            "fits": self.fits,
            "time": dict(self.time),
            "memory_parts_gib": {k: v / GiB for k, v in self.memory.items()},
        }

    def __str__(self) -> str:
        d = self.as_dict()
        mesh = " ".join(f"{a}={n}" for a, n in d["mesh"].items() if n > 1) or "1 device"
        budget = "-" if d["memory_budget_gib"] is None else f"{d['memory_budget_gib']:.1f}"
        rows = [
            ("cluster", f"{d['cluster']} ({d['stack']})"),
            (
                "plan",
                f"{mesh} zero{d['zero']} remat={d['remat']} {d['precision']} microbatches={d['microbatches']}"
                + (f" virtual={d['virtual']}" if d["virtual"] > 1 else "")
                + (" sequence-parallel" if d["sequence_parallel"] else ""),
            ),
            ("step time", f"{d['step_seconds'] * 1e3:.1f} ms"),
            ("tokens/s per device", f"{d['tokens_per_second_per_device']:,.0f}"),
            ("MFU", f"{100 * d['mfu']:.1f}%"),
            ("memory per device", f"{d['memory_gib']:.2f} GiB of {budget} GiB" + ("" if self.fits else " (too much)")),
            ("time parts", ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in d["time"].items() if k != "total")),
        ]
        return "\n".join(f"{k:<20} {v}" for k, v in rows)


def parse_mesh(text: str) -> dict[str, int]:
    """``"fsdp=8,tensor=2"`` -> every axis of `openhosti_jax.mesh.AXES` with its size (1 where not named).

    >>> parse_mesh("fsdp=8,tensor=2")
    {'stage': 1, 'data': 1, 'fsdp': 8, 'expert': 1, 'context': 1, 'tensor': 2}
    """
    sizes = dict.fromkeys(AXES, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise PlanningError(f"mesh entry {part!r}: expected AXIS=SIZE with AXIS one of {AXES} and SIZE >= 1")
        sizes[name] = int(value)
    return sizes


def predict(
    model: Any,
    optimizer: optax.GradientTransformation,
    sample_batch: Any,
    where: Cluster | str,
    *,
    mesh: Mapping[str, int] | str | None = None,
    zero: int | None = None,
    remat: str | None = None,
    precision: str | None = None,
    microbatches: int = 1,
    virtual: int = 1,
    sequence_parallel: bool | None = None,
    pipeline: bool = True,
    model_flops_per_token: float | None = None,
    memory_budget: int | None = None,
    exhaustive: bool = False,
) -> Prediction:
    """The `Prediction` for training ``model`` (an nnx module, linen module or init function, built abstractly:
    nothing is allocated) with ``optimizer`` on a global batch shaped like ``sample_batch`` over ``where`` (a
    `Cluster` or a name, e.g. ``"64xH100"``, ``"v5p-128"``).

    Use it instead of `openhosti_jax.choose_plan` (which returns the plan to train with on the attached devices, or
    with ``cluster=`` the plan for one that is not) when the question is what the run would cost: step time,
    tokens/s, MFU and memory per device, for the planner's choice or a configuration fixed by hand. It is what
    ``openhosti predict`` prints.

    With ``mesh`` (``{"fsdp": 8}`` or ``"fsdp=8"``) the configuration is fixed (``zero`` default 3 where a batch
    axis shards state else 0, ``remat`` default "none", ``precision`` default "bf16", ``microbatches``);
    without it, the planner chooses among every mesh (pipelines included unless ``pipeline=False``), ZeRO stage,
    remat policy, precision (``remat`` / ``precision`` restrict it) and gradient accumulation over microbatches
    (the run is priced as `openhosti_jax.make_train_step`'s step, which accumulates, as every peer stack's trainer
    does); ``virtual`` > 1 interleaves that many model chunks per pipeline stage and ``sequence_parallel`` splits
    the activations between blocks over the tensor axis
    (a fixed configuration's; default: where the mesh has a tensor axis, as the planner does). A pipelined mesh
    with a tensor axis needs a stack whose stages split over it (`Stack.pipeline_tensor`), else `PlanningError`.
    ``model_flops_per_token``: the model's training FLOPs per token for the utilisation (default: the traced matmul
    FLOPs). ``exhaustive``: the planner scores every candidate rather than skip those that provably cannot fit or
    win (the same choice, `openhosti_jax.planner.prune`)."""
    c = cluster(where)
    tx = optimizer
    work = workload(model, sample_batch)
    tokens = work.global_batch * max(work.tokens_per_example, 1)
    flops = model_flops_per_token or work.flops_per_example / max(work.tokens_per_example, 1)
    budget = memory_budget if memory_budget is not None else c.profile.memory_bytes
    if mesh is None:
        plan, report = choose_plan(
            model,
            tx,
            sample_batch,
            cluster=c,
            pipeline=pipeline,
            remat=remat or "auto",
            precision=precision or "auto",
            memory_budget=budget,
            accumulate=True,
            exhaustive=exhaustive,
        )
        parts = report.predicted_parts or {}
        seconds, nbytes = float(report.predicted_seconds or 0.0), float(report.predicted_bytes or 0)
    else:
        sizes = parse_mesh(mesh) if isinstance(mesh, str) else {**dict.fromkeys(AXES, 1), **dict(mesh)}
        if math.prod(sizes.values()) != c.n_devices:
            raise PlanningError(
                f"the mesh {sizes} spans {math.prod(sizes.values())} devices but the cluster has {c.n_devices}; "
                "give axis sizes whose product is the device count"
            )
        for axis, trait, lacks in (
            ("tensor", "pipeline_tensor", "split only the batch"),
            ("context", "pipeline_context", "do not split sequences"),
            ("expert", "pipeline_expert", "do not split experts"),
        ):
            if sizes["stage"] > 1 and sizes.get(axis, 1) > 1 and not getattr(c.stack, trait):
                able = sorted(name for name, s in STACKS.items() if getattr(s, trait))
                raise PlanningError(
                    f"the mesh {sizes} pipelines over a {axis} axis, but the {c.stack.name!r} stack's pipeline "
                    f"stages {lacks} (Stack.{trait} is False); drop the {axis} axis or the stages, or price a stack "
                    f"whose stages do: {able}"
                )
        sharded = replicas(sizes) > 1
        stage = (3 if sharded else 0) if zero is None else zero
        axes = hybrid_axes(sizes)
        if sequence_parallel is None:
            sequence_parallel = sizes["tensor"] > 1
        candidate = Candidate(
            sizes, stage, axes, remat or "none", precision or "bf16", microbatches, virtual, sequence_parallel
        )
        scored = score(work, tx, candidate, c)
        plan, parts = scored.plan, {"time": scored.estimate.time, "memory": scored.estimate.memory}
        seconds, nbytes = scored.estimate.seconds, float(scored.estimate.bytes)
    return Prediction(
        plan, c, seconds, int(tokens), float(flops), nbytes, budget, parts.get("time", {}), parts.get("memory", {})
    )
