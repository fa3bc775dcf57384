"""The planner's predictions held to the compiler where the plans will run: the library's own training step
(`openhosti_jax.demo.examples.token_train_step`: next-token loss, AdamW, bf16 compute over fp32 parameters) on
Llama-3 8B / 70B / 405B shapes, compiled ahead of time for TPU v5p and v6e slices of 64 to 1,024 chips with libtpu
(no TPU attached), beside the cost model's bytes per device for the same plan (`openhosti_jax.predict(...,
compile=True)`: the path ``openhosti predict --compile`` takes).

- ``own_pred_over_compiled_tpu_memory``: per case the compiler accepted, predicted over compiled bytes per device
  (the compiler's peak, `openhosti_jax.planner.aot`); ``tpu_compiled_cases`` counts them.
- ``tpu_fit_agreement``: the share of all cases (those refused with ``RESOURCE_EXHAUSTED`` included) where the
  prediction's "fits the chip's HBM" agrees with the compiler's verdict.
- ``cases``: every case with its plan, predicted and compiled GiB, verdicts and compile seconds.

Each case compiles in its own process (an 8B step compiles in 0.5-3 minutes on 2 cores). Layers are the models' own
(the blocks are scanned, so depth barely changes the compile time), except where ``layers`` cuts them, priced the
same way. ``--quick`` (CI): three cases of the whole 8B on 16 and 32 chips, the same code path (a 2-layer model
strays furthest, its output head and embedding dwarfing the layers: 1.18 for a 2-layer 8B without remat on 32).

Prints one JSON object on its last line (keys and goals: ``benchmarks/README.md``). Run:
``python benchmarks/tpu_compile.py`` (``--quick``; ``--case JSON`` runs one case).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only processes share libtpu (no TPU is opened)

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import goals  # noqa: E402

GiB = 2**30

# (model, seq, layers or None, mesh, zero, remat, target): FSDP, FSDP x tensor, data x FSDP, the context axis, a
# pipeline (stage x fsdp, ZeRO-1 inside the stages, four microbatches per replica);
# remat none / dots / full; 64 to 1,024 chips; two cases past a chip's HBM, which the compiler refuses
CASES: tuple[tuple[str, int, int | None, str, int, str, str], ...] = (
    ("llama3-8b", 2048, None, "fsdp=64", 3, "none", "v5p-128"),
    ("llama3-8b", 8192, None, "fsdp=64", 3, "none", "v5p-128"),
    ("llama3-8b", 8192, None, "fsdp=64", 3, "full", "v5p-128"),
    ("llama3-8b", 4096, None, "fsdp=64", 3, "dots", "v5p-128"),
    ("llama3-8b", 8192, None, "fsdp=16,tensor=4", 3, "dots", "v5p-128"),
    ("llama3-8b", 4096, None, "data=4,fsdp=16", 3, "full", "v5p-128"),
    ("llama3-8b", 4096, None, "fsdp=256", 3, "full", "v6e-256"),
    ("llama3-8b", 16384, None, "fsdp=64", 3, "none", "v5p-128"),
    ("llama3-70b", 4096, None, "fsdp=64", 3, "full", "v5p-128"),
    ("llama3-70b", 8192, None, "fsdp=32,tensor=4", 3, "full", "v5p-256"),
    ("llama3-70b", 2048, None, "fsdp=256", 3, "dots", "v5p-512"),
    ("llama3-70b", 8192, None, "fsdp=64", 3, "none", "v5p-128"),
    ("llama3-405b", 4096, 32, "fsdp=512", 3, "full", "v5p-1024"),
    ("llama3-405b", 8192, 32, "fsdp=128,tensor=8", 3, "full", "v5p-2048"),
    ("llama3-8b", 131072, None, "fsdp=4,context=16", 3, "full", "v5p-128"),
    ("llama3-8b", 2048, 8, "stage=2,fsdp=16", 1, "full", "v5p-64"),
)
QUICK_CASES: tuple[tuple[str, int, int | None, str, int, str, str], ...] = (
    ("llama3-8b", 1024, None, "fsdp=16", 3, "full", "v5p-32"),
    ("llama3-8b", 2048, None, "fsdp=8,tensor=2", 3, "dots", "v5p-32"),
    ("llama3-8b", 1024, None, "fsdp=32", 3, "none", "v5p-64"),
)


def run_case(case: tuple[Any, ...]) -> dict[str, Any]:
    """One case: the prediction for its plan and the compiler's verdict on it, in this process."""
    import optax

    from openhosti_jax.demo.examples import token_train_step
    from openhosti_jax.models.presets import model_preset
    from openhosti_jax.planner.predict import parse_mesh, predict
    from openhosti_jax.planner.search import replicas

    name, seq, layers, mesh, zero, remat, target = case
    model = model_preset(name, seq_len=seq, **({"n_layers": layers} if layers else {}))
    sizes = parse_mesh(mesh)
    # one sequence per data-parallel replica; a pipeline four per replica (its microbatches)
    batch = model.sample_batch(max(replicas(sizes), 1) * (4 if sizes["stage"] > 1 else 1))
    start = time.perf_counter()
    kw = {"mesh": mesh, "zero": zero, "remat": remat, "precision": "bf16"}
    p = predict(model.init, optax.adamw(1e-4), batch, target, compile=True, step_fn=token_train_step, **kw)
    if sizes["stage"] > 1:  # the pipeline's own step and state, lowered from shapes alone
        p = dataclasses.replace(p, compiled=pipelined_check(model, batch, p))
    check = p.compiled
    budget = p.memory_budget or 0
    return {
        "case": f"{name}{f' ({layers} layers)' if layers else ''} seq {seq} {mesh} zero{zero} remat={remat} {target}",
        "predicted_gib": p.memory_bytes / GiB,
        "compiled_gib": None if check.compiled_bytes is None else check.compiled_bytes / GiB,
        "status": check.status,
        "predicted_fits": p.memory_bytes <= budget,
        "compiled_fits": bool(check.fits),
        "predicted_over_compiled": check.predicted_over_compiled if check.fits else None,
        "compile_seconds": round(check.seconds, 1),
        "seconds": round(time.perf_counter() - start, 1),
    }


def pipelined_check(model: Any, batch: Any, p: Any) -> Any:
    """The pipelined plan of ``p`` compiled for its TPU target (`openhosti_jax.train.pipelined.lower_pipelined`:
    next-token loss over the stages, the stage-local state made from shapes)."""
    import optax

    from openhosti_jax.mesh.config import AXES
    from openhosti_jax.mesh.topology import target_mesh
    from openhosti_jax.models.gpt import next_token_loss
    from openhosti_jax.planner.aot import cluster_target, compile_check
    from openhosti_jax.train.pipelined import lower_pipelined

    def mean_loss(logits: Any, tokens: Any) -> Any:
        total, count = next_token_loss(logits, tokens)
        return total / count

    target = cluster_target(p.cluster)
    mesh = target_mesh(target, dict(p.plan.mesh_shape), AXES)
    lowered = lower_pipelined(model.init, optax.adamw(1e-4), mesh, p.plan, (batch, batch), mean_loss)
    return compile_check(lowered, target, "pipelined", predicted_bytes=p.memory_bytes)


def main() -> None:
    if "--case" in sys.argv:
        print(json.dumps(run_case(tuple(json.loads(sys.argv[sys.argv.index("--case") + 1])))))
        return
    from openhosti_jax.mesh.topology import libtpu_available

    t0 = time.perf_counter()
    out: dict[str, Any] = {"quick": goals.QUICK, "libtpu": libtpu_available()}
    if not out["libtpu"]:
        out.update(
            own_pred_over_compiled_tpu_memory=None,
            tpu_compiled_cases=0,
            tpu_fit_agreement=None,
            skipped='libtpu is not installed (pip install "openhosti_jax[tpu]"): nothing compiles for TPU',
        )
        goals.emit(out, __file__)
        return
    rows = []
    for case in QUICK_CASES if goals.QUICK else CASES:
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--case", json.dumps(case)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            rows.append({"case": " ".join(map(str, case)), "error": done.stderr.strip()[-1500:]})
            continue
        rows.append(json.loads(lines[-1]))
    good = [r for r in rows if "error" not in r]
    out["cases"] = rows
    out["own_pred_over_compiled_tpu_memory"] = [
        round(r["predicted_over_compiled"], 4) for r in good if r["predicted_over_compiled"] is not None
    ]
    out["tpu_compiled_cases"] = len(out["own_pred_over_compiled_tpu_memory"])
    out["tpu_refused_cases"] = sum(1 for r in good if not r["compiled_fits"])
    out["tpu_fit_agreement"] = (
        sum(r["predicted_fits"] == r["compiled_fits"] for r in good) / len(rows) if rows else None
    )  # a case that failed to compile counts against it
    out["seconds"] = round(time.perf_counter() - t0, 1)
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
