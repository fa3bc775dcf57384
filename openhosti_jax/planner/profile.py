"""Device profiles for the cost model: peak FLOP/s, memory bandwidth, link alpha-beta per collective, memory size.

Accelerators come from their published specs; CPU (and any unknown kind) is measured at run time by
`calibrate`: a matmul and an elementwise op run on every device at once (so shared cores are accounted for),
and all-reduce / all-gather / reduce-scatter at two sizes give each collective's latency (alpha) and bandwidth
(beta). Any field can be overridden with `dataclasses.replace` or by passing a profile to the planner.

Example:
    >>> from openhosti_jax.planner.profile import PROFILES
    >>> p = PROFILES["H100"]
    >>> round(p.collective_seconds("all_reduce", 2**30, 8) * 1e3, 1)  # 1 GiB all-reduce over 8 GPUs, in ms
    4.2
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PlanningError

COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
"""Collective kinds the cost model prices."""


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Speeds of one device and its links (per device, as seen while all devices work at once)."""

    name: str
    """Device kind, e.g. ``"H100"`` or ``"cpu (measured)"``."""
    peak_flops: float
    """Dense matmul FLOP/s one device sustains."""
    memory_bandwidth: float
    """Bytes/s of elementwise (memory-bound) work per device."""
    link_bandwidth: Mapping[str, float]
    """Collective kind -> bus bandwidth in bytes/s (the beta of the alpha-beta model)."""
    link_latency: float
    """Seconds of fixed cost per collective (alpha)."""
    memory_bytes: int | None = None
    """Device memory, the default memory budget (None: unknown, no default budget)."""

    def __post_init__(self) -> None:
        problems = [
            f"{k}={getattr(self, k)!r} must be > 0"
            for k in ("peak_flops", "memory_bandwidth")
            if not getattr(self, k) > 0
        ]
        missing = [c for c in COLLECTIVES if c not in self.link_bandwidth]
        if missing:
            problems.append(f"link_bandwidth lacks {missing}; give bytes/s for each of {COLLECTIVES}")
        problems += [f"link_bandwidth[{k!r}]={v!r} must be > 0" for k, v in self.link_bandwidth.items() if v <= 0]
        if self.link_latency < 0:
            problems.append(f"link_latency={self.link_latency!r} must be >= 0")
        if problems:
            raise PlanningError("invalid DeviceProfile: " + "; ".join(problems))

    def collective_seconds(self, kind: str, nbytes: float, n: int) -> float:
        """Alpha-beta time of one collective over ``n`` devices on a buffer of ``nbytes`` (the full buffer).

        all-reduce: 2(n-1)/n * bytes / bw; all-gather and reduce-scatter: (n-1)/n * bytes / bw.
        """
        if n <= 1 or nbytes <= 0:
            return 0.0
        factor = 2.0 if kind == "all_reduce" else 1.0
        return self.link_latency + factor * (n - 1) / n * nbytes / self.link_bandwidth[kind]


def _uniform(name: str, flops: float, mem_bw: float, link_bw: float, latency: float, mem: int) -> DeviceProfile:
    return DeviceProfile(name, flops, mem_bw, dict.fromkeys(COLLECTIVES, link_bw), latency, mem)


GiB = 2**30
PROFILES: dict[str, DeviceProfile] = {
    # bf16 dense peak, HBM bandwidth, NVLink / ICI bandwidth per device, from the vendors' spec sheets.
    "H100": _uniform("H100", 989e12, 3.35e12, 450e9, 10e-6, 80 * GiB),
    "H200": _uniform("H200", 989e12, 4.8e12, 450e9, 10e-6, 141 * GiB),
    "TPU v4": _uniform("TPU v4", 275e12, 1.2e12, 270e9, 10e-6, 32 * GiB),
    "TPU v5e": _uniform("TPU v5e", 197e12, 0.82e12, 200e9, 10e-6, 16 * GiB),
    "TPU v5p": _uniform("TPU v5p", 459e12, 2.76e12, 600e9, 10e-6, 95 * GiB),
}
"""Spec-sheet profiles by device kind."""

_KIND_ALIASES = {
    "h100": "H100",
    "h200": "H200",
    "tpu v4": "TPU v4",
    "tpu v5 lite": "TPU v5e",
    "tpu v5e": "TPU v5e",
    "tpu v5p": "TPU v5p",
    "tpu v5": "TPU v5p",
}


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float], factor: float) -> tuple[float, float]:
    """(alpha, bandwidth) from two timings of ``factor * nbytes`` bus traffic."""
    (s0, s1), (t0, t1) = sizes, seconds
    slope = max((t1 - t0) / (factor * (s1 - s0)), 1e-15)
    return max(t0 - slope * factor * s0, 0.0), 1.0 / slope


def calibrate(devices: Sequence[jax.Device] | None = None, *, reps: int = 5) -> DeviceProfile:
    """Measure a profile for ``devices`` (default: all) by timing small kernels on all of them at once."""
    devices = list(devices or jax.devices())
    n = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object), ("d",), axis_types=(AxisType.Explicit,))
    sharded = NamedSharding(mesh, P("d"))

    def on_all(f: Callable, *shapes: tuple[int, ...]) -> float:
        xs = [jax.device_put(jnp.ones((n, *s), jnp.float32), sharded) for s in shapes]
        g = jax.jit(jax.shard_map(lambda *a: f(*(x[0] for x in a))[None], mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        return _median_seconds(lambda: g(*xs), reps)

    m = 512
    flops = 2 * m**3 / on_all(lambda a, b: a @ b, (m, m), (m, m))
    k = 2**20
    mem_bw = 3 * 4 * k / on_all(lambda a, b: a * 1.5 + b, (k,), (k,))
    if n == 1:
        return DeviceProfile("cpu (measured)", flops, mem_bw, dict.fromkeys(COLLECTIVES, 1e12), 0.0)
    bandwidth, latencies = {}, []
    sizes = (2**14, 2**21)
    collectives = {
        "all_reduce": (2.0, lambda a: jax.lax.psum(a, "d")),
        "all_gather": (1.0, lambda a: jax.lax.all_gather(a[: a.shape[0] // n], "d", tiled=True)),
        "reduce_scatter": (1.0, lambda a: jax.lax.psum_scatter(a, "d", tiled=True)),
    }
    for kind, (factor, f) in collectives.items():
        secs = [on_all(f, (s // 4,)) for s in sizes]
        alpha, bw = _fit_alpha_beta([s * (n - 1) / n for s in sizes], secs, factor)
        bandwidth[kind] = bw
        latencies.append(alpha)
    return DeviceProfile(f"{devices[0].platform} (measured)", flops, mem_bw, bandwidth, float(np.median(latencies)))


@functools.cache
def _calibrated(device_ids: tuple[int, ...]) -> DeviceProfile:
    by_id = {d.id: d for d in jax.devices()}
    return calibrate([by_id[i] for i in device_ids])


def device_profile(
    devices: Sequence[jax.Device] | None = None, override: DeviceProfile | str | None = None
) -> DeviceProfile:
    """The profile for ``devices``: ``override`` (a profile or a `PROFILES` key), the spec sheet for a known
    accelerator kind, else a (cached) run-time calibration."""
    if isinstance(override, DeviceProfile):
        return override
    if isinstance(override, str):
        if override not in PROFILES:
            raise PlanningError(
                f"unknown device profile {override!r}; expected one of {sorted(PROFILES)} or a DeviceProfile"
            )
        return PROFILES[override]
    devices = list(devices or jax.devices())
    kind = devices[0].device_kind.lower()
    for alias, name in _KIND_ALIASES.items():
        if alias in kind:
            return PROFILES[name]
    return _calibrated(tuple(d.id for d in devices))
