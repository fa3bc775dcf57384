"""The demo job: train `GPT` on the bundled corpus with an automatic plan, progress, metrics and checkpoints.

Used by ``openhosti train``, ``examples/train_gpt.py``, the tests and the benchmarks.

Example:
    >>> from openhosti_jax.demo.gpt_job import GPTJob, run_job
    >>> result = run_job(GPTJob(steps=2, progress=False, print_plan=False))
    >>> len(result.history)
    2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from openhosti_jax.data import ArrayDataset
from openhosti_jax.errors import ConfigError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.microbatch import make_train_step
from openhosti_jax.models.gpt import GPT, GPTConfig, make_corpus, next_token_loss
from openhosti_jax.planner.choose import choose_plan
from openhosti_jax.sharding.plan import ShardingPlan
from openhosti_jax.state.contracts import SummedLossFn
from openhosti_jax.state.model import model_parts
from openhosti_jax.state.train_state import TrainState
from openhosti_jax.train import FitResult, SpmdStep, Trainer, TrainerCheckpoint, create_train_state, spmd
from openhosti_jax.train.create import resolve_plan
from openhosti_jax.train.logs import log_to_file


@dataclasses.dataclass(frozen=True)
class GPTJob:
    """Everything the demo run needs."""

    model: GPTConfig = dataclasses.field(default_factory=GPTConfig.tiny)
    """Model shape."""
    steps: int = 50
    """Optimizer steps."""
    global_batch: int = 32
    """Sequences per step (all devices)."""
    num_sequences: int = 2048
    """Corpus size in sequences."""
    learning_rate: float = 3e-3
    """Adam learning rate."""
    plan: str | int = "fsdp"
    """Sharding strategy: "fsdp", "dp", "zero1", "zero2", a ZeRO stage, or "auto": the planner chooses the mesh
    shape and ZeRO stage (`openhosti_jax.choose_plan`, the winner AOT-compiled) and ``mesh`` is not used. The
    demo's front ends (``openhosti train``, ``examples/train_gpt.py``) pass "auto" unless told otherwise; this
    field's default is the fixed layout the tests of one mesh build on."""
    mesh: MeshConfig = dataclasses.field(default_factory=lambda: MeshConfig(data=1, fsdp=-1))
    """Mesh axis sizes (for a named strategy)."""
    seed: int = 0
    """Seeds init, data order and dropout."""
    metrics_path: str | None = None
    """JSONL metrics file."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (None: no checkpoints)."""
    checkpoint_every_steps: int | None = None
    """Also save every K steps (time-based saves happen every 15 minutes regardless)."""
    progress: bool = True
    """Show the progress bar."""
    print_plan: bool = True
    """Print the sharding plan before training."""
    log_path: str | None = None
    """Where warnings and library log lines go while training (None: the terminal)."""
    replan: bool = False
    """Plan again on resume instead of keeping the plan the checkpoint was trained with."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.global_batch < 1 or self.num_sequences < self.global_batch:
            raise ConfigError(
                f"expected steps >= 1 and 1 <= global_batch <= num_sequences, found steps={self.steps}, "
                f"global_batch={self.global_batch}, num_sequences={self.num_sequences}"
            )


def gpt_loss_sum_fn(apply_fn: Callable[..., jax.Array], model_state: Any) -> SummedLossFn:
    """``loss_sum_fn(params, batch, rng) -> (sum of token losses, number of tokens)`` (`SummedLossFn`) for
    `make_train_step` and `openhosti_jax.balanced_step`; a batch with ``"segment_ids"`` is packed
    (`openhosti_jax.models.segments`)."""

    def loss_sum_fn(params: Any, batch: dict[str, jax.Array], rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        seg = batch.get("segment_ids")
        packed = {} if seg is None else {"segment_ids": seg}
        logits = apply_fn(params, batch["tokens"], rng, model_state=model_state, **packed)
        return next_token_loss(logits, batch["tokens"], batch.get("mask"), seg)

    return loss_sum_fn


def gpt_train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, Any]]:
    """One optimizer step of next-token prediction (dropout keys from ``state.rng``)."""
    step = make_train_step(gpt_loss_sum_fn(state.apply_fn, state.model_state))
    return step(state, batch)


def kept_plan(checkpoint: TrainerCheckpoint | None, job: GPTJob) -> tuple[dict[str, Any] | None, str | None]:
    """(the plan decision a resumed run keeps, a line saying what happened to the plan); (None, None) for a fresh
    run. The saved plan is kept unless ``job.replan``, the device count changed, or it pipelined."""
    saved = checkpoint.saved_meta() if checkpoint is not None else None
    decision = (saved or {}).get("plan_decision")
    if decision is None:
        return None, None
    step = checkpoint.manager.latest_good_step()
    if job.replan:
        return None, f"resumed from step {step}: planning again, as asked (the saved plan is not kept)"
    if decision.get("devices") != jax.device_count():
        return None, (
            f"resumed from step {step}: the checkpoint's plan ran on {decision.get('devices')} devices and this run "
            f"has {jax.device_count()}, so the planner chose again"
        )
    if decision.get("pipeline_stages", 1) > 1:
        return None, f"resumed from step {step}: the saved plan pipelined; the planner chose again"
    return decision, f"resumed from step {step}: keeping the plan the checkpoint was trained with"


def build_job(
    job: GPTJob, mesh: Mesh | None = None, keep: dict[str, Any] | None = None
) -> tuple[TrainState, ShardingPlan, SpmdStep, ArrayDataset]:
    """(sharded state, plan, the @spmd step, the data iterator) for ``job``; ``step.report`` says why the plan.

    With ``job.plan == "auto"`` and no ``mesh`` the planner searches mesh shapes x ZeRO stages for all devices;
    with a ``mesh`` it chooses the ZeRO stage on that mesh. ``keep`` (a `ShardingPlan.decision` from a checkpoint,
    see `kept_plan`) rebuilds that plan instead, on ``mesh``'s devices.
    """
    tx = optax.adam(job.learning_rate)
    init_fn = lambda r: GPT(job.model, rngs=nnx.Rngs(r))
    if keep is not None:
        devices = None if mesh is None else list(mesh.devices.flat)
        mesh = build_mesh(MeshConfig.from_sizes(dict(keep["mesh_shape"])), devices)
        fields = {k: keep[k] for k in ("num_microbatches", "remat", "precision")}
        fields["sequence_parallel"] = bool(keep.get("sequence_parallel", False))
        fields["collective_matmul"] = bool(keep.get("collective_matmul", False))
        plan, report = resolve_plan(keep["zero_stage"], model_parts(init_fn, mesh=mesh).params, tx, mesh, **fields)
    elif job.plan == "auto" and mesh is None:
        tokens = jax.ShapeDtypeStruct((job.global_batch, job.model.seq_len), jnp.int32)
        plan, report = choose_plan(init_fn, tx, tokens, step_fn=lambda s, t: gpt_train_step(s, {"tokens": t}))
        mesh = build_mesh(MeshConfig.from_sizes(dict(plan.mesh_shape)))
    else:
        mesh = mesh or build_mesh(job.mesh)
        plan, report = resolve_plan(job.plan, model_parts(init_fn, mesh=mesh).params, tx, mesh)
    state, plan = create_train_state(init_fn, tx, mesh, plan=plan, seed=job.seed)
    step = spmd(gpt_train_step, mesh=mesh, plan=plan)
    step.report = report
    corpus = make_corpus(job.num_sequences, job.model.seq_len, seed=job.seed)
    data = ArrayDataset({"tokens": corpus}, job.global_batch, seed=job.seed)
    return state, plan, step, data


def plan_meta(plan: ShardingPlan) -> dict[str, Any]:
    """What a checkpoint records about the plan: its table and its decision (with the device count)."""
    return {"plan": str(plan), "plan_decision": {**plan.decision(), "devices": jax.device_count()}}


def build_resumable_job(
    job: GPTJob, mesh: Mesh | None, checkpoint: TrainerCheckpoint | None
) -> tuple[TrainState, ShardingPlan, SpmdStep, ArrayDataset]:
    """`build_job` with the plan a checkpoint recorded kept (`kept_plan`, said in ``step.report``), and the plan
    recorded in what ``checkpoint`` saves from now on."""
    keep, note = kept_plan(checkpoint, job)
    state, plan, step, data = build_job(job, mesh, keep)
    if note:
        step.report.record(note)
    if checkpoint is not None:
        checkpoint.meta.update(plan_meta(plan))
    return state, plan, step, data


def run_job(job: GPTJob, mesh: Mesh | None = None) -> FitResult:
    """Build and train; print the plan first (``job.print_plan``). A run resuming from ``job.checkpoint_dir``
    keeps the plan it was saved with (`kept_plan`)."""
    checkpoint = None
    if job.checkpoint_dir is not None:
        checkpoint = TrainerCheckpoint(job.checkpoint_dir, every_steps=job.checkpoint_every_steps)
    state, _, step, data = build_resumable_job(job, mesh, checkpoint)
    if job.print_plan and jax.process_index() == 0:
        print(step.report)
    trainer = Trainer(
        step,
        metrics_path=job.metrics_path,
        progress=job.progress,
        checkpoint=checkpoint,
        learning_rate=job.learning_rate,
    )
    if job.log_path is None:
        return trainer.fit(state, data, num_steps=job.steps)
    with log_to_file(job.log_path):
        return trainer.fit(state, data, num_steps=job.steps)
