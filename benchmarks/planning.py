"""Planning a cluster that is not attached: how long `openhosti predict` takes to choose, and whether the pruned
search (`openhosti_jax.planner.prune`) chooses what the exhaustive one does.

Llama-3.1 405B (the preset: 126 scanned layers, sequences of 8,192), a global batch of 2,048 sequences (16M
tokens), AdamW, the planner free over every mesh (pipelines included), ZeRO stage, remat policy, precision and
microbatch count, on 1,024 H100 (128 hosts of 8) and on a TPU v5p-1024 slice (512 chips, one ICI domain): nothing
is compiled. For each cluster, in one process:

- ``predict_planning_seconds_<cluster>``: the median wall time of 3 calls of `openhosti_jax.predict` (the model
  traced abstractly, the candidates enumerated and scored, the winner chosen), each from a fresh model.
- ``pruned_choice_matches_exhaustive``: the pruned search's winner is the exhaustive search's (``exhaustive=True``),
  the same plan (mesh, ZeRO stage, remat, precision, microbatches; the same spec digest) at the same predicted step
  time and memory, on every cluster.
- ``exhaustive_over_pruned_planning_seconds_<cluster>`` (the exhaustive choice's wall time over the pruned one's
  median, side by side) and ``pruned_over_exhaustive_estimates_<cluster>`` (candidates scored, pruned over
  exhaustive: counts, not times).

    python benchmarks/planning.py          # about 30 s on the 2-core machine (``--quick``: the same)

Last stdout line: one JSON object.
"""

from __future__ import annotations

import os
import re
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import goals  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from openhosti_jax.models.presets import model_preset  # noqa: E402
from openhosti_jax.planner.choose import choose_plan  # noqa: E402
from openhosti_jax.planner.cluster import cluster  # noqa: E402
from openhosti_jax.planner.predict import predict  # noqa: E402

CLUSTERS = ("1024xH100", "v5p-1024")
REPEATS = 3
"""Timed `predict` calls per cluster (the median is the key): the first of a process also pays jax's warm-up."""


def scored(report) -> int:
    """The candidates a search scored, from its report's note (`openhosti_jax.planner.search.why`)."""
    return int(next(m[1] for n in report.notes if (m := re.match(r"(\d+) candidates scored", n))))


def main() -> None:
    preset = model_preset("llama3-405b")
    batch = jax.ShapeDtypeStruct((2048, preset.config.seq_len), jnp.int32)
    out: dict = {"model": "llama3-405b", "global_batch": [2048, preset.config.seq_len], "choices": {}}
    matches = []
    for name in CLUSTERS:
        key = name.replace("-", "_")
        seconds = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            p = predict(model_preset("llama3-405b").init, optax.adamw(1e-4), batch, name)
            seconds.append(time.perf_counter() - t0)
        c = cluster(name)
        reports = {}
        for exhaustive in (False, True):  # predict's own call of the planner, once each way
            t0 = time.perf_counter()
            reports[exhaustive] = choose_plan(
                preset.init,
                optax.adamw(1e-4),
                batch,
                cluster=c,
                pipeline=True,
                remat="auto",
                precision="auto",
                memory_budget=c.profile.memory_bytes,
                accumulate=True,
                exhaustive=exhaustive,
            )
            reports[exhaustive] += (time.perf_counter() - t0,)
        (pruned_plan, pruned, _), (full_plan, full, full_s) = reports[False], reports[True]
        same = (
            pruned_plan.decision() == full_plan.decision()
            and pruned_plan.digest() == full_plan.digest()
            and (pruned.predicted_seconds, pruned.predicted_bytes) == (full.predicted_seconds, full.predicted_bytes)
            and p.plan.digest() == pruned_plan.digest()
        )
        matches.append(same)
        median = statistics.median(seconds)
        out[f"predict_planning_seconds_{key}"] = round(median, 2)
        out[f"exhaustive_over_pruned_planning_seconds_{key}"] = round(full_s / median, 2)
        out[f"pruned_over_exhaustive_estimates_{key}"] = round(scored(pruned) / scored(full), 4)
        out["choices"][name] = {
            "plan": pruned.notes[0].split(":")[0],
            "predicted_step_s": round(pruned.predicted_seconds, 3),
            "predict_seconds": [round(s, 2) for s in seconds],
            "exhaustive_seconds": round(full_s, 2),
            "scored": {"pruned": scored(pruned), "exhaustive": scored(full)},
            "exhaustive_plan": full.notes[0].split(":")[0],
        }
        print(name, out["choices"][name], flush=True)
    out["pruned_choice_matches_exhaustive"] = all(matches)
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
