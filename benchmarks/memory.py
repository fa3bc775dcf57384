"""Memory benchmark: remat, ZeRO-3's gathered parameters, mixed-precision state, and the deepest GPT that fits.

Everything is read from XLA's compiled ``memory_analysis()`` of the real train step (the bundled GPT, Adam,
next-token loss) on 8 simulated CPU devices; nothing is allocated.

- ``remat_full_temp_over_none``: compiled temporaries of the 12-layer scanned GPT, remat ``full`` over ``none``,
  data-parallel over 8 devices, at a batch where the activations (the temporaries' growth from batch 8 to 16,
  scaled) are at least half of the no-remat temporaries (``activation_share_of_none_temp`` says how much).
  The same ratio for the GPT whose blocks are an unrolled list is reported beside it: XLA's CPU scheduler runs the
  recomputation early there, so the saving is the scan's (as MaxText's ``scan_layers``).
- ``zero3_gathered_params_over_one_layer``: as the issue defines it, compiled temporaries of the ZeRO-3 step minus
  those of the ZeRO-2 step on the same ``fsdp=8`` mesh, over one layer's parameter bytes, for the scanned 12-layer
  GPT. ``zero3_temp_growth_per_layer`` adds what each further layer adds to the ZeRO-3 temporaries beyond the ZeRO-2
  step's (6 vs 12 layers), over one layer's bytes: about 0 when one layer is gathered at a time, about 1 when every
  gathered layer stays alive.
- ``mixed_state_over_formula``: the compiled step's argument bytes minus its batch (the state: bf16 parameters, the
  fp32 master copy and fp32 Adam moments) over the formula 2P + (4P + 8P) per replica, at ZeRO 0 and 3.
- ``largest_fitting_model_over_zero0``: the deepest scanned GPT whose plan compiles within a fixed per-device budget
  with the planner free (mesh, ZeRO stage, remat, precision), over the deepest that plain replicated data parallel
  fits.

Prints one JSON object on its last line (keys and goals: ``benchmarks/README.md``). Run:
``python benchmarks/memory.py`` (``--quick``: the scanned GPT's remat only, the planner checked at 6x DP's depth).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402
from typing import Any  # noqa: E402

import goals  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from openhosti_jax.demo.examples import gpt_step  # noqa: E402
from openhosti_jax.errors import MemoryBudgetError  # noqa: E402
from openhosti_jax.mesh import MeshConfig, build_mesh  # noqa: E402
from openhosti_jax.models.gpt import GPT, GPTConfig  # noqa: E402
from openhosti_jax.planner import choose_plan  # noqa: E402
from openhosti_jax.planner.verify import lower_step  # noqa: E402
from openhosti_jax.planner.workload import workload  # noqa: E402
from openhosti_jax.policies.optimizers import optimizer_for  # noqa: E402
from openhosti_jax.policies.precision import PRECISIONS, state_bytes_per_param  # noqa: E402
from openhosti_jax.sharding.plan import ShardingPlan  # noqa: E402

TX = optax.adam(1e-3)
SEQ = 64


def gpt(layers: int, d_model: int = 128, scan: bool = True) -> GPTConfig:
    return GPTConfig(n_layers=layers, d_model=d_model, n_heads=4, seq_len=SEQ, scan_layers=scan)


def layer_bytes(cfg: GPTConfig) -> int:
    d, h = cfg.d_model, cfg.d_model * cfg.mlp_ratio
    return 4 * (4 * d + 3 * d * d + d * d + d + d * h + h + h * d + d)


def compiled(cfg: GPTConfig, batch: int, mesh_shape: dict[str, int], stage: int, **fields: Any) -> Any:
    """The compiled step's memory analysis for ``cfg`` under a fixed plan."""
    work = workload(lambda r: GPT(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((batch, SEQ), jnp.int32))
    tx = optimizer_for(TX, fields.get("precision", "fp32"))
    plan = ShardingPlan.from_zero(work.params, tx, mesh_shape, stage, **fields)
    mesh = build_mesh(MeshConfig.from_sizes(plan.mesh_shape))
    return lower_step(plan, work, TX, gpt_step, mesh).compile().memory_analysis()


def remat_ratios() -> dict[str, float]:
    batch = 64
    out: dict[str, float] = {}
    for scan in (True,) if goals.QUICK else (True, False):  # quick: the scanned GPT only
        cfg = gpt(12, scan=scan)
        none = compiled(cfg, batch, {"data": 8}, 0).temp_size_in_bytes
        full = compiled(cfg, batch, {"data": 8}, 0, remat="full").temp_size_in_bytes
        dots = compiled(cfg, batch, {"data": 8}, 0, remat="dots").temp_size_in_bytes
        key = "" if scan else "_unrolled_list"
        out[f"remat_full_temp_over_none{key}"] = full / none
        out[f"remat_dots_temp_over_none{key}"] = dots / none
        if scan:
            small = compiled(cfg, batch // 2, {"data": 8}, 0).temp_size_in_bytes
            activations = 2 * (none - small)  # what the batch adds, scaled to the whole batch
            out["activation_share_of_none_temp"] = activations / none
    return out


def zero3_gathered() -> dict[str, float]:
    temps = {}
    for layers in (6, 12):
        cfg = gpt(layers, d_model=256)
        for stage in (2, 3):
            temps[(layers, stage)] = compiled(cfg, 8, {"fsdp": 8}, stage).temp_size_in_bytes
    one = layer_bytes(gpt(12, d_model=256))
    growth = ((temps[12, 3] - temps[6, 3]) - (temps[12, 2] - temps[6, 2])) / 6
    return {
        "zero3_gathered_params_over_one_layer": (temps[12, 3] - temps[12, 2]) / one,
        "zero3_temp_growth_per_layer": growth / one,
        "zero3_temp_over_zero2_temp": temps[12, 3] / temps[12, 2],
    }


def mixed_state() -> list[float]:
    cfg = gpt(4, d_model=256)
    out = []
    for stage, mesh_shape in ((0, {"data": 8}), (3, {"fsdp": 8})):
        analysis = compiled(cfg, 8, mesh_shape, stage, precision="bf16_params")
        batch = 8 * SEQ * 4 / 8
        state = analysis.argument_size_in_bytes - batch
        out.append(state / (cfg.num_params() * state_bytes_per_param(PRECISIONS["bf16_params"], stage, 8)))
    return out


def fits_dp(layers: int, budget: int, batch: int) -> bool:
    a = compiled(gpt(layers, d_model=256), batch, {"data": 8}, 0)
    return a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes - a.alias_size_in_bytes <= budget


def fits_planned(layers: int, budget: int, batch: int) -> tuple[bool, str]:
    cfg = gpt(layers, d_model=256)
    try:
        plan, report = choose_plan(
            lambda r: GPT(cfg, rngs=nnx.Rngs(r)),
            TX,
            jax.ShapeDtypeStruct((batch, SEQ), jnp.int32),
            step_fn=gpt_step,
            memory_budget=budget,
            device_profile="H100",
            remat="auto",
            precision="auto",
        )
    except MemoryBudgetError:
        return False, ""
    return True, report.candidates[0].label if report.candidates else ""


def deepest(fits: Any, start: int = 1, limit: int = 512) -> tuple[int, Any]:
    """The largest depth for which ``fits(depth)`` holds (doubling, then bisection)."""
    lo, info = 0, None
    hi = start
    while hi <= limit:
        ok = fits(hi)
        ok, extra = ok if isinstance(ok, tuple) else (ok, None)
        if not ok:
            break
        lo, info, hi = hi, extra, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = fits(mid)
        ok, extra = ok if isinstance(ok, tuple) else (ok, None)
        if ok:
            lo, info = mid, extra
        else:
            hi = mid
    return lo, info


def largest_fitting() -> dict[str, Any]:
    """The deepest GPT each way fits; quick mode checks the planner at 6x plain DP's depth only (a lower bound)."""
    batch = 16
    budget = 48 * 2**20
    dp_depth, _ = deepest(lambda n: fits_dp(n, budget, batch))
    if goals.QUICK:
        target = 6 * max(dp_depth, 1)
        ok, label = fits_planned(target, budget, batch)
        fallback = lambda: deepest(lambda n: fits_planned(n, budget, batch), limit=target)  # noqa: E731
        planned_depth, label = (target, label) if ok else fallback()
    else:
        planned_depth, label = deepest(lambda n: fits_planned(n, budget, batch), start=max(dp_depth, 1))
    return {
        "largest_fitting_model_over_zero0": planned_depth / max(dp_depth, 1),
        "largest_fitting": {
            "budget_bytes": budget,
            "zero0_layers": dp_depth,
            "planned_layers": planned_depth,
            "planned_layers_is": "checked at 6x plain DP (a lower bound)" if goals.QUICK else "the deepest",
            "planned_choice": label,
            "d_model": 256,
            "global_batch": batch,
        },
    }


def main() -> None:
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    out.update(remat_ratios())
    out.update(zero3_gathered())
    out["mixed_state_over_formula"] = mixed_state()
    out.update(largest_fitting())
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["devices"] = len(jax.devices())
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
