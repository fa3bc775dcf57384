"""Achievable efficiency on the accelerator present: matmul FLOP/s against size (bf16 and fp32) and elementwise
bandwidth against working-set size, measured with jitted JAX kernels, for the device profiles' efficiency curves.

Each point is the median of ``--repeats`` timed calls after a warm-up, the result fetched with
``block_until_ready``. Matmuls are square ``n x n @ n x n`` (2 n^3 FLOPs); the elementwise kernel is ``x * a + b``
over ``n`` float32 values (12 bytes moved per element: two reads, one write).

    python benchmarks/gpu_kernels.py            # on a GPU: about a minute
    python benchmarks/gpu_kernels.py --quick    # small sizes, 3 repeats, on the accelerator present (CPU if none)
    python benchmarks/gpu_kernels.py --dry-run  # the same small sizes, forced onto the CPU (tests)

Last stdout line: one JSON object (`goals.emit`; benchmarks/README.md: no goal is asserted for the gpu_*.py
scripts): ``device``, ``platform``, ``matmul`` (dtype -> list of [n, TFLOP/s]), ``elementwise`` (list of
[bytes, GB/s]), and ``matmul_bf16_peak_tflops`` / ``elementwise_peak_gbs`` (the best seen).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import goals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="small sizes on CPU")
    p.add_argument("--quick", action="store_true", help="small sizes on the accelerator present (CPU if none)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 10; small sizes 3)")
    args = p.parse_args(argv)
    small = args.dry_run or args.quick
    args.repeats = args.repeats or (3 if small else 10)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    def timed(fn, *xs) -> float:
        jax.block_until_ready(fn(*xs))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*xs))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    sizes = [128, 256, 512] if small else [256, 512, 1024, 2048, 4096, 8192, 16384]
    matmul: dict[str, list[list[float]]] = {}
    mm = jax.jit(lambda a, b: a @ b)
    for dtype in ("bfloat16", "float32"):
        matmul[dtype] = []
        for n in sizes:
            k1, k2 = jax.random.split(jax.random.key(n))
            a = jax.random.normal(k1, (n, n), dtype)
            b = jax.random.normal(k2, (n, n), dtype)
            matmul[dtype].append([n, 2 * n**3 / timed(mm, a, b) / 1e12])
            del a, b
    elementwise = []
    ew = jax.jit(lambda x, a, b: x * a + b)
    for n in [2**k for k in (range(12, 20, 2) if small else range(14, 31, 2))]:
        x = jnp.ones((n,), jnp.float32)
        seconds = timed(ew, x, jnp.float32(1.0001), jnp.float32(0.5))
        elementwise.append([4 * n, 12 * n / seconds / 1e9])
        del x
    out = {
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "matmul": matmul,
        "elementwise": elementwise,
        "matmul_bf16_peak_tflops": max(t for _, t in matmul["bfloat16"]),
        "elementwise_peak_gbs": max(g for _, g in elementwise),
    }
    goals.emit(out, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
