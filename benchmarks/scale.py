"""The planner at cluster scale against published training runs.

Each run below is a published measurement, written as data with its source: the model, the cluster, the global
batch, the configuration the authors used (mesh, ZeRO stage, recomputation, precision, microbatches) and the
throughput (and memory, where given) they report. The cost model predicts the same configuration from abstract
shapes with the one profile of the device type (`openhosti_jax.planner.profiles.PROFILES`: nothing here is fitted to
a run), and the planner makes its own choice for the same model, cluster and batch.

Keys (BENCHMARKS.md): ``<run>_tput_pred_over_pub`` (predicted / published tokens/s per device),
``<run>_mem_pred_over_pub`` (where the source gives memory), ``choice_over_published_config`` (per run: the
planner's choice over the published configuration, both predicted, and whether the choice fits), ``seed_175b_64xH100``
(the seed's claim: GPT-3 175B on 64 H100, the planner's choice against plain DDP and the claimed 156 tokens/s per
GPU), ``plan_405b_1024_seconds`` (wall time of planning Llama-3.1 405B on 1,024 H100, no compiles).

Published throughput in TFLOP/s per GPU is turned into tokens/s with the source's own FLOP count per token (Megatron's
``96 l h^2 (1 + s/(6h) + V/(16 l h))`` per sequence position counts the recomputed forward; its README's MFU does
not), so the ratio compares like with like.

    python benchmarks/scale.py        # about a minute on CPU

Last stdout line: one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from openhosti_jax.models.gpt import GPT, GPTConfig  # noqa: E402
from openhosti_jax.models.presets import ModelPreset, model_preset  # noqa: E402
from openhosti_jax.planner.predict import Prediction, predict  # noqa: E402


def megatron_flops_per_token(layers: int, hidden: int, seq: int, vocab: int, recompute: bool) -> float:
    """Narayanan et al. 2021, eq. (3) per token: ``72 (or 96 with recomputation) l h^2 (1 + s/(6h) + V/(16 l h))``."""
    return (96 if recompute else 72) * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def gpt(name: str, layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 51200) -> ModelPreset:
    """A GPT of Megatron's shapes (4h MLP, learned positions), scanned, query-blocked attention."""
    cfg = GPTConfig(
        vocab_size=vocab,
        seq_len=seq,
        d_model=hidden,
        n_heads=heads,
        n_layers=layers,
        scan_layers=True,
        attention_block=min(512, seq),
    )
    return ModelPreset(name, cfg, GPT)


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run: what was trained, where, how, and what was measured."""

    key: str
    model: ModelPreset
    cluster: str
    global_batch: int
    """Sequences per step."""
    mesh: str
    zero: int
    remat: str
    precision: str
    microbatches: int
    published_tokens_per_s: float
    """Per device."""
    source: str
    published_memory_gib: float | None = None


RUNS: list[Run] = []
"""The published runs (filled from their sources below)."""


def predicted(run: Run, config: bool) -> Prediction:
    batch = jax.ShapeDtypeStruct((run.global_batch, run.model.config.seq_len), jnp.int32)
    fixed: dict[str, Any] = (
        {
            "mesh": run.mesh,
            "zero": run.zero,
            "remat": run.remat,
            "precision": run.precision,
            "microbatches": run.microbatches,
        }
        if config
        else {}
    )
    return predict(
        run.model.init,
        optax.adamw(1e-4),
        batch,
        run.cluster,
        model_flops_per_token=run.model.flops_per_token,
        **fixed,
    )


def main() -> None:
    out: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    for run in RUNS:
        pub = predicted(run, config=True)
        out[f"{run.key}_tput_pred_over_pub"] = round(pub.tokens_per_second_per_device / run.published_tokens_per_s, 3)
        if run.published_memory_gib is not None:
            out[f"{run.key}_mem_pred_over_pub"] = round(pub.memory_bytes / 2**30 / run.published_memory_gib, 3)
        own = predicted(run, config=False)
        choice[run.key] = {
            "ratio": round(own.tokens_per_second_per_device / pub.tokens_per_second_per_device, 3),
            "choice": own.as_dict()["mesh"] | {"zero": own.plan.zero_stage, "remat": own.plan.remat},
            "fits": own.fits,
            "published_config_fits_predicted": pub.fits,
        }
        print(run.key, pub, own, sep="\n", flush=True)
    out["choice_over_published_config"] = choice
    seed = model_preset("gpt3-175b")
    batch = jax.ShapeDtypeStruct((1536, 2048), jnp.int32)
    own = predict(seed.init, optax.adamw(1e-4), batch, "64xH100", model_flops_per_token=seed.flops_per_token)
    ddp = predict(seed.init, optax.adamw(1e-4), batch, "64xH100", mesh="data=64", zero=0)
    out["seed_175b_64xH100"] = {
        "choice_tokens_per_s_per_gpu": round(own.tokens_per_second_per_device, 1),
        "choice": own.as_dict()["mesh"] | {"zero": own.plan.zero_stage, "remat": own.plan.remat},
        "choice_fits": own.fits,
        "ddp_fits": ddp.fits,
        "ddp_memory_gib": round(ddp.memory_bytes / 2**30, 1),
        "seed_claim_tokens_per_s_per_gpu": 156,
        "choice_over_seed_claim": round(own.tokens_per_second_per_device / 156, 3),
    }
    big = model_preset("llama3-405b")
    t0 = time.perf_counter()
    predict(big.init, optax.adamw(1e-4), jax.ShapeDtypeStruct((2048, 8192), jnp.int32), "1024xH100")
    out["plan_405b_1024_seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
