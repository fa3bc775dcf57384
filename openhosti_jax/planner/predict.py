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
from openhosti_jax.flops import CAUSAL_ATTENTION_COUNTED
from openhosti_jax.mesh.config import AXES
from openhosti_jax.planner.aot import FORECAST, CompiledCheck, cluster_target, compile_on_target
from openhosti_jax.planner.choose import choose_plan
from openhosti_jax.planner.cluster import Cluster, cluster
from openhosti_jax.planner.profiles import UNCALIBRATED_MATMUL_EFFICIENCY
from openhosti_jax.planner.search import Candidate, hybrid_axes, replicas, score
from openhosti_jax.planner.stacks import STACKS
from openhosti_jax.planner.verify import default_step
from openhosti_jax.planner.workload import Workload, workload
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.state.contracts import StepFn

GiB = 2**30
MFU_COUNTS = "causal attention counted half, as MaxText and Megatron-LM"
"""How `Prediction.mfu` counts a model's FLOPs (`openhosti_jax.flops.CAUSAL_ATTENTION_COUNTED`)."""
UNCALIBRATED = (
    f"uncalibrated: no measured or published matmul rate for this device, matmuls priced at "
    f"{100 * UNCALIBRATED_MATMUL_EFFICIENCY:.1f}% of its peak"
)
"""What a `Prediction` on an uncalibrated device prints beside its figures."""


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
    """Training FLOPs per token the utilisation counts (the model's own formula, else the traced matmuls), a causal
    attention's at `openhosti_jax.flops.CAUSAL_ATTENTION_COUNTED` of its square (MaxText's and Megatron-LM's
    count); the step time prices what the kernels run."""
    memory_bytes: float
    """Predicted bytes per device."""
    memory_budget: int | None
    time: Mapping[str, float]
    """Seconds per step by part (compute, memory, collectives, ...)."""
    memory: Mapping[str, float]
    """Bytes per device by part (state, batch, temporaries)."""
    compiled: CompiledCheck | None = None
    """The plan compiled for the target (``compile=True`` on a TPU target), else None: a forecast."""

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
    def calibrated(self) -> bool:
        """Whether the device's achievable matmul rate is measured or published
        (`openhosti_jax.planner.profiles.DeviceProfile.calibrated`); False: its matmuls were priced at
        `openhosti_jax.planner.profiles.UNCALIBRATED_MATMUL_EFFICIENCY` of the peak, an assumption, and the step
        time is a bound, not a measurement's prediction."""
        return self.cluster.profile.calibrated

    @property
    def fits(self) -> bool:
        """Whether the plan fits: the compiler's word where it was compiled (a program it refuses never fits),
        else the predicted memory within the budget (no budget: True)."""
        if self.compiled is not None and self.compiled.fits is not None:
            return bool(self.compiled.fits) and (
                self.memory_budget is None
                or self.compiled.compiled_bytes is None
                or self.compiled.compiled_bytes <= self.memory_budget
            )
        return self.memory_budget is None or self.memory_bytes <= self.memory_budget

    @property
    def verified(self) -> str:
        """How the memory figure was checked: ``"compiled for TARGET"``, or `FORECAST`."""
        return f"compiled for {self.compiled.target}" if self.compiled and self.compiled.fits is not None else FORECAST

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
            "mfu_counts": MFU_COUNTS,
            "calibrated": self.calibrated,
            "memory_gib": self.memory_bytes / GiB,
            "memory_budget_gib": None if self.memory_budget is None else self.memory_budget / GiB,
            "fits": self.fits,
            "verified": self.verified,
            "compiled_gib": None
            if self.compiled is None or self.compiled.compiled_bytes is None
            else self.compiled.compiled_bytes / GiB,
            "predicted_over_compiled": None if self.compiled is None else self.compiled.predicted_over_compiled,
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
            ("MFU", f"{100 * d['mfu']:.1f}% ({MFU_COUNTS})"),
            ("device profile", "calibrated" if d["calibrated"] else UNCALIBRATED),
            (
                "memory per device",
                f"{d['memory_gib']:.2f} GiB of {budget} GiB predicted" + ("" if self.fits else " (too much)"),
            ),
            (
                "checked",
                self.verified + ("" if d["compiled_gib"] is None else f": {d['compiled_gib']:.2f} GiB compiled"),
            ),
            ("time parts", ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in d["time"].items() if k != "total")),
        ]
        return "\n".join(f"{k:<20} {v}" for k, v in rows)


def model_flops_per_example(work: Workload) -> float:
    """The model FLOPs per example MFU counts, from the trace: its matmul FLOPs (`Workload.flops_per_example`), the
    attention matmuls behind a fixed (causal) mask at `openhosti_jax.flops.CAUSAL_ATTENTION_COUNTED` of what the
    trace computes (every block of the square, the masked ones too: `Workload.attention_work`).

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.models.gpt import GPT, GPTConfig
    >>> cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=16, n_heads=2, n_layers=2)
    >>> w = workload(lambda r: GPT(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((4, 32), jnp.int32))
    >>> model_flops_per_example(w) == cfg.flops_per_token() * cfg.seq_len
    True
    """
    a = work.attention_work()
    masked = a.attention_share if a.masked else 0.0
    return work.flops_per_example * (1 - masked * (1 - CAUSAL_ATTENTION_COUNTED))


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
    compile: bool = False,
    step_fn: StepFn | None = None,
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
    FLOPs, `model_flops_per_example`). ``compile`` (a TPU target: ``"v5p-128"``): the plan is compiled ahead of time
    for it (`openhosti_jax.planner.aot`; libtpu needed, no TPU): `Prediction.compiled` holds the compiler's bytes and
    verdict, and `Prediction.fits` follows the compiler; planned (no ``mesh``), the ranked candidates are compiled
    until one fits. A GPU cluster cannot be compiled here: the prediction says "forecast, not compiled"; nor is a
    pipelined plan's step here (its state is the pipeline's: `openhosti_jax.train.pipelined.lower_pipelined` lowers
    it, as ``openhosti predict --compile`` does).
    ``step_fn(state, batch)`` is the step compiled (default: the mean output as the loss). ``exhaustive``: the
    planner scores every candidate rather than skip those that provably cannot fit or win (the same choice,
    `openhosti_jax.planner.prune`)."""
    c = cluster(where)
    target = cluster_target(where) if compile else None
    checked: CompiledCheck | None = None
    tx = optimizer
    work = workload(model, sample_batch)
    tokens = work.global_batch * max(work.tokens_per_example, 1)
    flops = model_flops_per_token or model_flops_per_example(work) / max(work.tokens_per_example, 1)
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
            compile=compile,
            step_fn=step_fn,
            exhaustive=exhaustive,
        )
        parts = report.predicted_parts or {}
        if compile and target is not None:
            checked = CompiledCheck(
                target.name,
                _label(plan),
                float(report.predicted_bytes or 0),
                report.compiled_bytes,
                budget,
                None if report.compiled_bytes is None else report.compiled_bytes <= (budget or report.compiled_bytes),
            )
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
        if compile and target is not None and plan.pipeline_stages == 1:  # a pipeline's step: lower_pipelined
            checked = compile_on_target(
                plan,
                work,
                tx,
                step_fn or default_step,
                target,
                predicted_bytes=nbytes,
                candidate=candidate.label,
                budget=budget,
            )
    return Prediction(
        plan,
        c,
        seconds,
        int(tokens),
        float(flops),
        nbytes,
        budget,
        parts.get("time", {}),
        parts.get("memory", {}),
        checked,
    )


def _label(plan: ShardingPlan) -> str:
    mesh = " ".join(f"{a}={n}" for a, n in plan.mesh_shape.items() if n > 1) or "1 device"
    return f"{mesh} zero{plan.zero_stage} remat={plan.remat} {plan.precision} microbatches={plan.num_microbatches}"
