"""TPU attention benchmark: the Pallas splash kernel the library runs on TPU, its numerics, its memory, and whether
the library's own step really runs it.

- ``splash_interpret_max_rel_error``: causal grouped-query attention in bf16 (8 query heads over 2 kv heads, head
  dim 128) through the splash kernel in Pallas's interpreter on this CPU, against the same attention written out as
  a float32 softmax of einsums from the same bf16 inputs: the largest of ``max |got - want| / max |want|`` over the
  output and the gradients dq, dk, dv, for the kernel alone and, on 8 simulated devices, for the context axis's ring
  (blocks merged through their log-sum-exp) and all-gather strategies (``context=2`` x ``data=2`` and
  ``context=2`` x ``tensor=4``; the full mode only).
- ``splash_temp_over_xla_temp``: compiled temporaries of causal GQA attention, forward and backward (32 heads over
  8 kv heads, head dim 128, bf16, seq 8192, one sequence per chip on 4 TPU v5p chips), the splash kernel over the
  library's query-blocked XLA attention (blocks of 512 queries), both ahead-of-time compiles for the v5p topology
  from this CPU process (`jax.experimental.topologies`, libtpu; no TPU attached). The quick mode compiles seq 4096.
- ``tpu_attention_kernel``: the kernel the library's own Llama step (`openhosti_jax.planner.verify.lower_step`: the
  plan's shardings, AdamW, ``attention_kernel="auto"``) runs when lowered for a 4-chip v5p mesh, read from the
  lowered program: ``"splash"`` where it holds the kernel's Mosaic custom calls (``tpu_custom_call``), else
  ``"xla"``.

Without libtpu the compile keys print ``null`` and ``tpu_compile`` says it was skipped; the interpreter's numbers are
printed either way. Prints one JSON object on its last line (keys and goals: ``benchmarks/README.md``). Run:
``python benchmarks/tpu_attention.py`` (``--quick``: the kernel alone for the numerics, seq 4096 for the memory).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on the machine may hold libtpu too

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import goals  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from openhosti_jax.demo.examples import gpt_step  # noqa: E402
from openhosti_jax.mesh import MeshConfig, build_mesh  # noqa: E402
from openhosti_jax.models.attention import causal_attention  # noqa: E402
from openhosti_jax.models.llama import Llama, LlamaConfig  # noqa: E402
from openhosti_jax.models.splash import causal_block_fraction  # noqa: E402
from openhosti_jax.planner.verify import lower_step  # noqa: E402
from openhosti_jax.planner.workload import workload  # noqa: E402
from openhosti_jax.sharding.plan import ShardingPlan  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, CHIPS = 32, 8, 128, 4
TOPOLOGY = "v5p:2x2x1"


def reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal GQA attention as a float32 softmax of einsums (query head h reads kv head h // group)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    s, g = q.shape[1], q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def out_and_grads(fn: Any, q: jax.Array, k: jax.Array, v: jax.Array, ct: jax.Array) -> list[jax.Array]:
    out, vjp = jax.vjp(fn, q, k, v)
    return [x.astype(jnp.float32) for x in (out, *vjp(ct.astype(out.dtype)))]


def max_rel(got: list[jax.Array], want: list[jax.Array]) -> float:
    return max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want, strict=True))


def interpret_errors() -> dict[str, float]:
    """bf16 errors of the kernel in the interpreter against the float32 softmax, alone and under a context axis."""
    keys = jax.random.split(jax.random.key(0), 4)
    b, s = 2, 512
    q = jax.random.normal(keys[0], (b, s, 8, HEAD_DIM)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(x, (b, s, 2, HEAD_DIM)).astype(jnp.bfloat16) for x in keys[1:3])
    ct = jax.random.normal(keys[3], q.shape, jnp.float32)
    want = out_and_grads(reference, q, k, v, ct)
    cases: dict[str, tuple[dict[str, int] | None, str]] = {"alone": (None, "ring")}
    if not goals.QUICK:
        cases["ring"] = ({"data": 2, "context": 2}, "ring")
        cases["all_gather"] = ({"context": 2, "tensor": 4}, "all_gather")
    errors = {}
    for name, (sizes, strategy) in cases.items():
        fn = jax.jit(
            lambda *a, strategy=strategy: out_and_grads(
                lambda *x: causal_attention(*x, context_strategy=strategy, kernel="splash"), *a
            )
        )
        if sizes is None:
            got = fn(q, k, v, ct)
        else:
            mesh = build_mesh(MeshConfig.from_sizes(sizes), jax.devices()[: int(np.prod([*sizes.values()]))])
            with jax.set_mesh(mesh):
                got = fn(q, k, v, ct)
        errors[name] = max_rel(got, want)
    return errors


def tpu_devices() -> list[Any] | None:
    """Abstract TPU v5p chips to compile for, or None without libtpu."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    from jax.experimental import topologies

    return list(
        topologies.get_topology_desc(
            platform="tpu", topology_name=TOPOLOGY, chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1)
        ).devices
    )


def attention_memory(devices: list[Any], seq: int) -> dict[str, Any]:
    """Compiled temporaries and peak of attention forward + backward, splash against the query-blocked XLA path."""
    mesh = build_mesh(MeshConfig.from_sizes({"data": CHIPS}), devices)
    sharding = NamedSharding(mesh, P("data"))
    args = [jax.ShapeDtypeStruct((CHIPS, seq, h, HEAD_DIM), jnp.bfloat16, sharding=sharding) for h in (32, 8, 8, 32)]
    out: dict[str, Any] = {}
    for kernel in ("xla", "splash"):

        def step(q: jax.Array, k: jax.Array, v: jax.Array, ct: jax.Array, kernel: str = kernel) -> Any:
            _, vjp = jax.vjp(lambda *x: causal_attention(*x, block=512, kernel=kernel), q, k, v)
            return vjp(ct)

        t = time.perf_counter()
        with jax.set_mesh(mesh):
            lowered = jax.jit(step).lower(*args)
        analysis = lowered.compile().memory_analysis()
        out[kernel] = {
            "temp_gib": analysis.temp_size_in_bytes / 2**30,
            "peak_gib": analysis.peak_memory_in_bytes / 2**30,
            "custom_calls": lowered.as_text().count("tpu_custom_call"),
            "compile_seconds": round(time.perf_counter() - t, 1),
        }
    return out


def llama_kernel(devices: list[Any]) -> dict[str, Any]:
    """The kernel the library's Llama step runs when lowered for a TPU mesh, from the program text."""
    if goals.QUICK:
        cfg = LlamaConfig.tiny(seq_len=512, d_model=256, n_heads=4, n_kv_heads=2, ffn=256)
    else:  # Llama-3 8B's layer shapes at its 8192 tokens, 2 layers
        cfg = LlamaConfig.llama3_8b(n_layers=2)
    cfg = dataclasses.replace(cfg, dtype="bfloat16", scan_layers=True, attention_kernel="auto")
    work = workload(lambda r: Llama(cfg, rngs=nnx.Rngs(r)), jax.ShapeDtypeStruct((CHIPS, cfg.seq_len), jnp.int32))
    tx = optax.adamw(1e-4)
    plan = ShardingPlan.from_zero(work.params, tx, {"fsdp": CHIPS}, 3)
    text = lower_step(plan, work, tx, gpt_step, build_mesh(MeshConfig.from_sizes(plan.mesh_shape), devices)).as_text()
    calls = text.count("tpu_custom_call")
    return {
        "tpu_attention_kernel": "splash" if calls else "xla",
        "llama_step": {
            "model": f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads over {cfg.n_kv_heads}",
            "seq_len": cfg.seq_len,
            "mesh": f"fsdp={CHIPS} (ZeRO-3) on {TOPOLOGY}",
            "tpu_custom_calls": calls,
            "planner_trace_has_pallas": "pallas" in str(work.jaxpr),
        },
    }


def main() -> None:
    t0 = time.perf_counter()
    errors = interpret_errors()
    out: dict[str, Any] = {
        "splash_interpret_max_rel_error": max(errors.values()),
        "splash_interpret_rel_error_by_case": errors,
    }
    out["splash_blocks_computed_fraction_8192"] = causal_block_fraction(8192)  # of its 16 x 16 blocks of 512
    devices = tpu_devices()
    out["libtpu"] = devices is not None
    if devices is None:
        out.update(
            tpu_attention_kernel=None,
            splash_temp_over_xla_temp=None,
            tpu_compile="skipped: libtpu is not installed (pip install 'jax[tpu]'), so nothing compiles for TPU",
        )
    else:
        seq = 4096 if goals.QUICK else 8192
        memory = attention_memory(devices, seq)
        out["splash_temp_over_xla_temp"] = memory["splash"]["temp_gib"] / memory["xla"]["temp_gib"]
        out["splash_peak_over_xla_peak"] = memory["splash"]["peak_gib"] / memory["xla"]["peak_gib"]
        out["attention_memory"] = {"seq_len": seq, "chips": CHIPS, "topology": TOPOLOGY, **memory}
        out.update(llama_kernel(devices))
        out["tpu_compile"] = f"ahead of time for {TOPOLOGY} ({CHIPS} chips), no TPU attached"
    out["seconds"] = round(time.perf_counter() - t0, 1)
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
