"""Device profiles for the cost model, as data: peak FLOP/s, memory bandwidth, link alpha-beta per collective,
memory size, and the measured curves a calibration adds (`openhosti_jax.planner.calibrate`).

Accelerators come from their published specs (`PROFILES`). A profile prices a collective by interpolating the
measured curve of its group size where it has one (caches and protocol switches make bandwidth depend on the size,
which one straight line cannot follow, and small groups meet faster than large ones), else by its alpha-beta line.
Any field can be overridden with `dataclasses.replace` or by passing a profile to the planner.

Example:
    >>> from openhosti_jax.planner.profiles import PROFILES
    >>> p = PROFILES["H100"]
    >>> round(p.collective_seconds("all_reduce", 2**30, 8) * 1e3, 1)  # 1 GiB all-reduce over 8 GPUs, in ms
    4.2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

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
    link_curve: Mapping[str, Mapping[int, tuple[tuple[float, float], ...]]] = dataclasses.field(default_factory=dict)
    """Collective kind -> group size -> measured ``(bus bytes, seconds)`` points, sizes ascending, times
    non-decreasing. Where given, it prices that collective by piecewise-linear interpolation, each end segment
    extended, on the curve of the nearest measured group size (a small group's rendezvous is cheaper than a large
    one's); empty (spec-sheet profiles): the alpha-beta line."""
    memory_curve: tuple[tuple[float, float], ...] = ()
    """Measured ``(working-set bytes per device, bytes/s)`` points of elementwise work, sizes ascending,
    bandwidths non-increasing (a working set that fits the caches streams faster). Where given, `memory_seconds`
    interpolates it (log scale, clamped at the ends); empty (spec-sheet profiles): ``memory_bandwidth``."""
    launch_seconds: float = 0.0
    """Seconds a program takes to start and finish on all devices, paid once per step: a calibration times each
    kernel as a program of its own and subtracts this, so a collective is priced as one op inside the step."""
    native_reduce_scatter: bool = True
    """Whether a sharded gradient is reduce-scattered in place. XLA's CPU backend lowers GSPMD's reduce-scatter
    as a full all-reduce and a slice, so the full gradient is live twice (its input and output), as under ZeRO-0."""
    host_bandwidth: float = 32e9
    """Bytes/s between device and host memory one way, what remat ``"offload"`` moves its saved activations over
    (default: PCIe Gen4 x16). The H100 and H200 profiles take PCIe Gen5's 55 GB/s: an H200 step that offloaded
    6.4 GB of activations measured 0.22 s slower than keeping them (``benchmarks/gpu_memory.py``), 58 GB/s."""

    devices_per_host: int = 8
    """Devices in one host (a node): the group the intra-node link joins (`openhosti_jax.planner.cluster`)."""
    dcn_bandwidth: float = 25e9
    """Bytes/s each device sends across hosts, one way (its share of the node's InfiniBand / DCN)."""
    dcn_latency: float = 10e-6
    """Seconds of fixed cost per step of a cross-host collective (one per doubling of the host count)."""
    matmul_efficiency: float = 1.0
    """Fraction of ``peak_flops`` that large matmuls reach (a measured GEMM benchmark; 1.0: the peak)."""
    overlap: bool = False
    """Whether the compiler overlaps collectives with compute (XLA's latency-hiding scheduler on GPU and TPU):
    a step then takes the longer of compute and communication, not their sum (XLA's CPU backend does not)."""
    fp8_flops: float | None = None
    """Dense fp8 (TPU: int8) FLOP/s, where the device has them."""
    sources: tuple[str, ...] = ()
    """Where the numbers come from."""

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
        for kind, groups in self.link_curve.items():
            if kind not in COLLECTIVES or not isinstance(groups, Mapping) or not groups:
                problems.append(
                    f"link_curve[{kind!r}] must map a kind in {COLLECTIVES} to {{group size: points}}; found {groups!r}"
                )
                continue
            for n, points in groups.items():
                x, t = np.asarray([p[0] for p in points], float), np.asarray([p[1] for p in points], float)
                if (
                    not (isinstance(n, int) and n >= 2)
                    or len(points) < 2
                    or (np.diff(x) <= 0).any()
                    or (np.diff(t) < 0).any()
                ):
                    problems.append(
                        f"link_curve[{kind!r}][{n!r}] must be a group size >= 2 with >= 2 (bus bytes, seconds) "
                        f"points, sizes increasing and times non-decreasing; found {points}"
                    )
        ws, bw = np.asarray([p[0] for p in self.memory_curve], float), np.asarray([p[1] for p in self.memory_curve])
        if self.memory_curve and (
            len(ws) < 2 or (ws <= 0).any() or (np.diff(ws) <= 0).any() or (bw <= 0).any() or (np.diff(bw) > 0).any()
        ):
            problems.append(
                "memory_curve must hold >= 2 (working-set bytes, bytes/s) points, sizes increasing and > 0, "
                f"bandwidths > 0 and non-increasing; found {self.memory_curve}"
            )
        if self.launch_seconds < 0:
            problems.append(f"launch_seconds={self.launch_seconds!r} must be >= 0")
        if not 0 < self.matmul_efficiency <= 1:
            problems.append(f"matmul_efficiency={self.matmul_efficiency!r} must be in (0, 1]")
        if self.devices_per_host < 1 or self.dcn_bandwidth <= 0 or self.dcn_latency < 0:
            problems.append(
                f"devices_per_host={self.devices_per_host!r} must be >= 1, dcn_bandwidth={self.dcn_bandwidth!r} "
                f"> 0 and dcn_latency={self.dcn_latency!r} >= 0"
            )
        if self.link_latency < 0:
            problems.append(f"link_latency={self.link_latency!r} must be >= 0")
        if problems:
            raise PlanningError("invalid DeviceProfile: " + "; ".join(problems))

    def collective_seconds(self, kind: str, nbytes: float, n: int) -> float:
        """Time of one collective over groups of ``n`` devices on a buffer of ``nbytes`` (the full buffer).

        Bus bytes: all-reduce 2(n-1)/n * bytes, all-gather and reduce-scatter (n-1)/n * bytes; priced on the
        measured curve (`link_curve`) or the alpha-beta line ``latency + bus / bandwidth``.
        """
        if n <= 1 or nbytes <= 0:
            return 0.0
        bus = bus_bytes(kind, nbytes, n)
        if kind in self.link_curve:
            groups = self.link_curve[kind]
            nearest = min(groups, key=lambda g: (abs(np.log(g / n)), -g))
            return _interpolate(groups[nearest], bus)
        return self.link_latency + bus / self.link_bandwidth[kind]

    def memory_seconds(self, nbytes: float, working_set: float) -> float:
        """Time to stream ``nbytes`` of elementwise traffic on a device whose step touches ``working_set``
        bytes: at the bandwidth `memory_curve` gives for that working set, or ``memory_bandwidth``."""
        if not self.memory_curve:
            return nbytes / self.memory_bandwidth
        ws, bw = np.asarray(self.memory_curve, float).T
        return nbytes / float(np.interp(np.log(max(working_set, 1.0)), np.log(ws), bw))


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear ``seconds(bus bytes)`` through ``points``, the first and last segments extended
    (never below the smallest measured time: a collective costs at least its latency)."""
    xs, ts = np.asarray([p[0] for p in points], float), np.asarray([p[1] for p in points], float)
    i = int(np.clip(np.searchsorted(xs, x) - 1, 0, len(xs) - 2))
    slope = (ts[i + 1] - ts[i]) / (xs[i + 1] - xs[i])
    return float(max(ts[i] + slope * (x - xs[i]), ts[0] if x < xs[0] else 0.0, 1e-9))


def _spec(
    name: str,
    *,
    bf16: float,
    fp8: float | None,
    hbm: int,
    hbm_bandwidth: float,
    link: float,
    per_host: int,
    dcn: float,
    sources: tuple[str, ...],
    host_bandwidth: float = 32e9,
    matmul_efficiency: float = 1.0,
) -> DeviceProfile:
    """A spec-sheet profile: one link bandwidth for every collective kind, the compiler overlapping collectives with
    compute (XLA's latency-hiding scheduler on GPU and TPU), 10 us per collective inside a host."""
    return DeviceProfile(
        name,
        bf16,
        hbm_bandwidth,
        dict.fromkeys(COLLECTIVES, link),
        10e-6,
        hbm,
        host_bandwidth=host_bandwidth,
        devices_per_host=per_host,
        dcn_bandwidth=dcn,
        overlap=True,
        fp8_flops=fp8,
        sources=sources,
        matmul_efficiency=matmul_efficiency,
    )


GiB = 2**30
GB = 10**9
_H100 = (
    "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: bf16 1,979 TFLOPS and fp8 3,958 with sparsity, "
    "half dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s)"
)
_H200 = (
    "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB HBM3e at 4.8 TB/s; compute and NVLink "
    "900 GB/s as H100)"
)
_A100 = (
    "https://www.nvidia.com/en-us/data-center/a100/ (A100 SXM 80GB: bf16 312 TFLOPS dense, 624 with sparsity; "
    "80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s)"
)
_DGX_H100 = (
    "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html (DGX H100: 8 GPUs, 8 single-port "
    "ConnectX-7 400 Gb/s for the compute fabric, one per GPU)"
)
_DGX_A100 = (
    "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html (DGX A100: 8 GPUs, 8 single-port "
    "ConnectX-6 200 Gb/s HDR InfiniBand for the compute fabric, one per GPU)"
)
_MAMF = (
    "https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md (Maximum Achievable Matmul "
    "FLOPS, bf16 torch matmul, best shape: H100 SXM 794.5 of 989 TFLOPS, 80.3%, 'H200 is the same'; A100 SXM 271.2 "
    "of 312, 86.9%)"
)
PROFILES: dict[str, DeviceProfile] = {
    # Per device: bf16 and fp8/int8 dense peak, HBM size and bandwidth, the intra-host link one way (NVLink's
    # bidirectional figure halved; TPU ICI per chip), the inter-host link (one 400 / 200 Gb/s NIC per GPU; TPU DCN
    # per chip), devices per host. GPU hosts of 8 with NVLink inside and InfiniBand across; a TPU slice is one ICI
    # domain (`openhosti_jax.planner.cluster` spans slices over DCN). Memory sizes quoted in GB are the GiB the
    # devices report (an H100's 80 GB is 80 GiB).
    "H100": _spec(
        "H100",
        matmul_efficiency=0.803,
        bf16=989e12,
        fp8=1979e12,
        hbm=80 * GiB,
        hbm_bandwidth=3.35e12,
        link=450 * GB,
        per_host=8,
        dcn=50 * GB,
        host_bandwidth=55e9,
        sources=(_H100, _DGX_H100, _MAMF),
    ),
    "H200": _spec(
        "H200",
        matmul_efficiency=0.803,
        bf16=989e12,
        fp8=1979e12,
        hbm=141 * GiB,
        hbm_bandwidth=4.8e12,
        link=450 * GB,
        per_host=8,
        dcn=50 * GB,
        host_bandwidth=55e9,
        sources=(_H200, _DGX_H100, _MAMF),
    ),
    "A100": _spec(
        "A100",
        matmul_efficiency=0.869,
        bf16=312e12,
        fp8=None,
        hbm=80 * GiB,
        hbm_bandwidth=2.039e12,
        link=300 * GB,
        per_host=8,
        dcn=25 * GB,
        sources=(_A100, _DGX_A100, _MAMF),
    ),
    "TPU v4": _spec(
        "TPU v4",
        bf16=275e12,
        fp8=275e12,
        hbm=32 * GiB,
        hbm_bandwidth=1.2e12,
        link=300 * GB,
        per_host=4,
        dcn=6.25 * GB,
        sources=(
            "https://cloud.google.com/tpu/docs/v4 (bf16 and int8 275 TFLOPS, 32 GiB HBM2 at 1,200 GB/s, 4 chips per "
            "host, 3D torus of 6 ICI links of 400 Gb/s each way: 300 GB/s)",
            "DCN per chip not published for v4: v5p's 50 Gb/s per chip taken",
        ),
    ),
    "TPU v5e": _spec(
        "TPU v5e",
        bf16=197e12,
        fp8=393e12,
        hbm=16 * GiB,
        hbm_bandwidth=819 * GB,
        link=200 * GB,
        per_host=8,
        dcn=3.125 * GB,
        sources=(
            "https://cloud.google.com/tpu/docs/v5e (bf16 197 TFLOPS, int8 393 TOPS, 16 GB HBM2 at 819 GB/s, ICI "
            "1,600 Gb/s per chip, 8 chips per host, 2D torus)",
            "https://cloud.google.com/tpu/docs/v6e (v5e per-host NICs 2 x 100 Gb/s for 8 chips: 25 Gb/s per chip)",
        ),
    ),
    "TPU v5p": _spec(
        "TPU v5p",
        bf16=459e12,
        fp8=459e12,
        hbm=95 * GiB,
        hbm_bandwidth=2765 * GB,
        link=600 * GB,
        per_host=4,
        dcn=6.25 * GB,
        sources=(
            "https://cloud.google.com/tpu/docs/v5p (bf16 and fp8 459 TFLOPS, 95 GiB HBM at 2,765 GB/s, bidirectional "
            "ICI 1,200 GB/s per chip, DCN 50 Gb/s per chip, 4 chips per host, 3D torus)",
        ),
    ),
    "TPU v6e": _spec(
        "TPU v6e",
        bf16=918e12,
        fp8=1836e12,
        hbm=32 * GiB,
        hbm_bandwidth=1640 * GB,
        link=400 * GB,
        per_host=8,
        dcn=12.5 * GB,
        sources=(
            "https://cloud.google.com/tpu/docs/v6e (bf16 918 TFLOPS, int8 1,836 TOPS, 32 GB HBM at 1,640 GB/s, "
            "bidirectional ICI 800 GB/s per chip, 8 chips per host, 4 x 200 Gb/s NICs per host, 2D torus)",
        ),
    ),
}
"""Spec-sheet profiles by device kind, each citing its sources (`DeviceProfile.sources`)."""

KIND_ALIASES = {
    # device_kind substrings (lower case) -> PROFILES key
    "h100": "H100",
    "h200": "H200",
    "a100": "A100",
    "tpu v4": "TPU v4",
    "tpu v5 lite": "TPU v5e",
    "tpu v5e": "TPU v5e",
    "tpu v5p": "TPU v5p",
    "tpu v5": "TPU v5p",
    "tpu v6": "TPU v6e",
}


def bus_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device moves in a collective of ``kind`` over ``n`` devices on a full buffer of ``nbytes``."""
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes
