"""Device profiles for the cost model, as data: peak FLOP/s, memory bandwidth, link alpha-beta per collective,
memory size, and the measured curves a calibration adds (`openhosti_jax.planner.calibrate`).

Accelerators come from their published specs (`PROFILES`) and published measurements: the fraction of peak a
matmul reaches against its size (`DeviceProfile.matmul_curve`: the GPUs' from cuBLAS and MAMF sweeps, TPU v5e's from
JAX's own XLA matmul benchmark) and the fraction of a link's bus bandwidth a collective reaches against its message
size (``link_efficiency``, ``dcn_efficiency``, from nccl-tests tables), each point citing its source. A device with
no measured or published matmul rate (TPU v4, v5p, v6e) is *uncalibrated* (`DeviceProfile.calibrated`): its matmuls
are priced at `UNCALIBRATED_MATMUL_EFFICIENCY`, never at 100% of the peak, and a prediction on it says so. TPU
collectives stay on the alpha-beta line of the ICI / DCN spec (no message-size curve is published). A profile
measured here (`openhosti_jax.planner.calibrate`) prices a collective by interpolating the measured curve of its
group size (caches and protocol switches make bandwidth depend on the size, which one straight line cannot follow,
and small groups meet faster than large ones), else by its alpha-beta line. Any field can be overridden with
`dataclasses.replace` or by passing a profile to the planner.

Example:
    >>> from openhosti_jax.planner.profiles import PROFILES
    >>> p = PROFILES["A100"]
    >>> round(p.link_seconds("all_reduce", 2**24, 8) * 1e6, 1)  # nccl-tests' 16 MiB all-reduce on 8 A100: 276.6 us
    276.6
    >>> round(p.gemm_seconds(1024, 1024, 1024) * 1e6, 1)  # a 1024^3 bf16 GEMM at 26% of the 312 TFLOP/s peak
    26.1
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from openhosti_jax.errors import PlanningError

COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
"""Collective kinds the cost model prices."""

MEASURED: tuple[str, ...] = (*COLLECTIVES, "all_to_all")
"""Collective kinds a calibration measures (`DeviceProfile.link_curve`): `COLLECTIVES` and the all-to-all
(`all_to_all_seconds`), which no spec sheet gives a bandwidth of."""


@dataclasses.dataclass(frozen=True)
class CompilerMemory:
    """How a compiler lays out a training step's memory, where compilers differ (each field as measured from the
    compiled program's buffer assignment and live ranges: `XLA_TPU`, `XLA_CPU`)."""

    phase_peaks: bool = True
    """Whether the step's peak is the largest of its phases' (the forward's end: the loss's two output-sized copies
    and the gathered output head; the backward's start: the outputs' cotangent and the head's gradient; the layers'
    backward loop: one block's recomputed residuals; the gradient reduction), each over the checkpointed
    activations; False: the loss's copies and a block's residuals live into every phase."""
    keeps_gathered_weights: bool = False
    """Whether a ZeRO-3 weight's gathered copy is kept from the forward to the backward where no remat recomputes it
    (remat ``"none"``), rather than gathered again."""
    gradients_in_compute_dtype: bool = True
    """Whether a gathered weight's full gradient stays in the compute dtype until it is reduced (the gradient of the
    cast copy it was computed with); False: converted to the parameters' dtype first."""
    loss_copy_in_compute_dtype: bool = False
    """Whether, of the loss's two output-sized copies at the forward's end, one is the output head's product in the
    compute dtype (the fp32 logits made from it inside the loss's fusions) rather than a second fp32 copy."""


XLA_TPU = CompilerMemory()
"""XLA:TPU, as compiled ahead of time with libtpu 0.0.42 (Llama-3 8B on 64 v5p chips, fsdp=64, one sequence per
chip): at seq 8192 with remat full the peak (12.5 GiB) is the forward's end, the layers' inputs, the two fp32 logit
copies and the gathered bf16 output head, none of the head's gradient; with remat none (73.5 GiB) every layer's
residuals there and no layer's gathered weights; the gradients of gathered weights are reduced in bf16 (the
embedding's as a ``bf16[128256,4096]`` all-reduce)."""

XLA_TPU_V6E = CompilerMemory(loss_copy_in_compute_dtype=True)
"""XLA:TPU on v6e (libtpu 0.0.42): as `XLA_TPU`, but at the forward's end Llama-3 8B's loss holds its logits once in
fp32 (``f32[4096,128256]``, 2.1 GB) and once as the head's bf16 product (1.05 GB), where v5p holds two fp32 copies
(seq 4096, remat full, one sequence per chip: fsdp=64 on v6e-64 and fsdp=256 on v6e-256 compiled to 0.91 and 0.87
of the prediction with two fp32 copies; the same plan on v5p-512, 1.005)."""

XLA_CPU = CompilerMemory(phase_peaks=False, keeps_gathered_weights=True, gradients_in_compute_dtype=False)
"""XLA:CPU (jax 0.10.2), from the compiled footprints of width-true, 4-layer presets on 8 devices: they hold the
loss's copies and a block's residuals beside the backward's start and loop, the gathered weights of every layer
under remat none (four layers of Llama-2 7B at fsdp=8: 5.67 GiB compiled, 4.08 predicted without them), and the
vocabulary leaves' full gradients in fp32 (``f32[128256,4096]`` buffers for Llama-3 8B)."""


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
    memory: CompilerMemory = dataclasses.field(default_factory=lambda: XLA_TPU)
    """How the compiler lays out a step's memory (`CompilerMemory`): `XLA_TPU` (also taken for GPUs), or `XLA_CPU`
    for a calibrated CPU profile."""
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
    matmul_efficiency: float | None = None
    """Fraction of ``peak_flops`` that large matmuls reach, measured (a GEMM benchmark's; 1.0 where ``peak_flops``
    is itself a measured matmul rate, as a calibration's is), taken for every matmul where ``matmul_curve`` is
    empty. None: nothing measured or published, the profile is uncalibrated (`calibrated`) and its matmuls are
    priced at `UNCALIBRATED_MATMUL_EFFICIENCY`."""
    matmul_curve: tuple[tuple[float, float], ...] = ()
    """Achieved ``(GEMM size, fraction of peak_flops)`` points, sizes ascending, fractions non-decreasing: the size
    of an ``M x N x K`` matmul is the side of the cube of equal work, ``(M N K) ** (1/3)`` (a square GEMM's
    ``m = n = k``). `gemm_efficiency` interpolates it in log size, clamped at the ends."""
    link_efficiency: tuple[tuple[float, float], ...] = ()
    """Measured ``(message bytes, fraction of link_bandwidth)`` points of the intra-host link (nccl-tests' bus
    bandwidth over its asymptote), sizes ascending. Where given (and the kind has no ``link_curve``),
    `link_seconds` prices a collective at that fraction of ``link_bandwidth`` for its message size, no alpha
    (the measured small-message fall-off is the latency)."""
    dcn_efficiency: tuple[tuple[float, float], ...] = ()
    """The same for the inter-host link: ``(bytes each device sends across hosts, fraction of dcn_bandwidth)``."""
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
            if kind not in MEASURED or not isinstance(groups, Mapping) or not groups:
                problems.append(
                    f"link_curve[{kind!r}] must map a kind in {MEASURED} to {{group size: points}}; found {groups!r}"
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
        if self.matmul_efficiency is not None and not 0 < self.matmul_efficiency <= 1:
            problems.append(f"matmul_efficiency={self.matmul_efficiency!r} must be in (0, 1] or None (unmeasured)")
        for curve in ("matmul_curve", "link_efficiency", "dcn_efficiency"):
            points = getattr(self, curve)
            x, f = np.asarray([p[0] for p in points], float), np.asarray([p[1] for p in points], float)
            top = 1.0 if curve == "matmul_curve" else np.inf
            if points and (
                len(x) < 2
                or (x <= 0).any()
                or (np.diff(x) <= 0).any()
                or (f <= 0).any()
                or (f > top).any()
                or (np.diff(f) < 0).any()
            ):
                problems.append(
                    f"{curve} must hold >= 2 (size, fraction) points, sizes > 0 and increasing, fractions > 0 "
                    f"{'and <= 1 ' if top == 1 else ''}and non-decreasing; found {points}"
                )
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

    @property
    def calibrated(self) -> bool:
        """Whether the device's achievable matmul rate is measured or published (a ``matmul_curve`` or a
        ``matmul_efficiency``, cited in ``sources``); False: its matmuls are priced at
        `UNCALIBRATED_MATMUL_EFFICIENCY` of the peak, an assumption a prediction on it reports.

        >>> from openhosti_jax.planner.profiles import PROFILES, UNCALIBRATED_MATMUL_EFFICIENCY
        >>> PROFILES["H100"].calibrated, PROFILES["TPU v5e"].calibrated, PROFILES["TPU v5p"].calibrated
        (True, True, False)
        >>> round(PROFILES["TPU v5p"].achievable_matmul, 4), round(UNCALIBRATED_MATMUL_EFFICIENCY, 4)  # v5e's
        (0.923, 0.923)
        """
        return bool(self.matmul_curve) or self.matmul_efficiency is not None

    @property
    def achievable_matmul(self) -> float:
        """The fraction of ``peak_flops`` the largest matmuls reach (`gemm_efficiency` of an unbounded size): the
        most of the peak any step's matmuls can sustain on this device (uncalibrated: the assumed cap)."""
        return self.gemm_efficiency(math.inf)

    def gemm_efficiency(self, size: float) -> float:
        """Fraction of ``peak_flops`` a matmul of ``size`` (``(M N K) ** (1/3)``) reaches: `matmul_curve` in
        log size, clamped at its ends, or ``matmul_efficiency`` without one, or on an uncalibrated profile
        `UNCALIBRATED_MATMUL_EFFICIENCY`.

        >>> from openhosti_jax.planner.profiles import PROFILES
        >>> a100 = PROFILES["A100"]
        >>> a100.gemm_efficiency(8192) == a100.matmul_efficiency, round(a100.gemm_efficiency(1024), 3)
        (True, 0.264)
        """
        if self.matmul_curve:
            return _log_interp(self.matmul_curve, size)
        return UNCALIBRATED_MATMUL_EFFICIENCY if self.matmul_efficiency is None else self.matmul_efficiency

    def gemm_seconds(self, m: float, n: float, k: float) -> float:
        """Seconds of one ``M x K`` by ``K x N`` matmul: ``2 M N K / (peak x gemm_efficiency((M N K) ** (1/3)))``."""
        return 2.0 * m * n * k / (self.peak_flops * self.gemm_efficiency((m * n * k) ** (1 / 3)))

    def link_seconds(self, kind: str, nbytes: float, n: int) -> float:
        """Time of one collective inside a host at its message size: `collective_seconds`' bus bytes over
        ``link_bandwidth x`` the `link_efficiency` of ``nbytes`` (never below the smallest measured message's
        time), or `collective_seconds` where the profile has no such curve or a measured `link_curve`."""
        if not self.link_efficiency or kind in self.link_curve or n <= 1 or nbytes <= 0:
            return self.collective_seconds(kind, nbytes, n)
        return curve_seconds(self.link_efficiency, bus_bytes(kind, 1.0, n), nbytes, self.link_bandwidth[kind])

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


def _log_interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """``points``' second value at ``x``, linear in ``log x`` between points, clamped at the ends."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x) - 1
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def curve_seconds(curve: Sequence[tuple[float, float]], bus_per_byte: float, nbytes: float, bandwidth: float) -> float:
    """Seconds of ``bus_per_byte x nbytes`` bus bytes on a link of ``bandwidth`` whose measured efficiency at
    message size ``x`` is ``curve``'s ``(x, fraction)``: at each measured size its time, between two of them the
    straight line through their times (a latency plus bytes over a bandwidth), past the last at its fraction, and
    below the first what that one costs (a collective costs at least its latency). A larger message never costs
    less: each measured time counts at least the one before (an efficiency interpolated in ``log x`` made a
    64 KiB all-gather on eight H100s cheaper than a 32 KiB one).

    >>> curve = ((1e3, 0.01), (1e6, 0.5))
    >>> [round(curve_seconds(curve, 1.0, x, 1e9) * 1e6, 1) for x in (1e2, 1e3, 5e5, 1e6, 2e6)]
    [100.0, 100.0, 1049.0, 2000.0, 4000.0]
    """
    xs = [x for x, _ in curve]
    times = list(itertools.accumulate((bus_per_byte * x / (bandwidth * f) for x, f in curve), max))
    if nbytes <= xs[0]:
        return times[0]
    if nbytes >= xs[-1]:
        return bus_per_byte * nbytes / (bandwidth * curve[-1][1])
    i = bisect.bisect_right(xs, nbytes) - 1
    return times[i] + (times[i + 1] - times[i]) * (nbytes - xs[i]) / (xs[i + 1] - xs[i])


def _shape(points: Sequence[tuple[float, float]], over: float | None = None) -> tuple[tuple[float, float], ...]:
    """Measured ``(size, value)`` points as ``(size, value / over)`` (default: over the last value, the curve's
    asymptote): a curve's shape, to multiply a peak by."""
    top = points[-1][1] if over is None else over
    return tuple((x, v / top) for x, v in points)


def _spec(
    name: str,
    *,
    bf16: float,
    fp8: float | None,
    hbm: int,
    hbm_bandwidth: float,
    link: float | Mapping[str, float],
    per_host: int,
    dcn: float,
    sources: tuple[str, ...],
    host_bandwidth: float = 32e9,
    matmul_curve: tuple[tuple[float, float], ...] = (),
    link_efficiency: tuple[tuple[float, float], ...] = (),
    dcn_efficiency: tuple[tuple[float, float], ...] = (),
    memory: CompilerMemory = XLA_TPU,
) -> DeviceProfile:
    """A spec-sheet profile: a link bandwidth per collective kind (one number: every kind), the compiler
    overlapping collectives with compute (XLA's latency-hiding scheduler on GPU and TPU), 10 us per collective
    inside a host where no measured `DeviceProfile.link_efficiency` prices it; the large-GEMM efficiency is the
    top of ``matmul_curve`` (none: uncalibrated, `DeviceProfile.calibrated`)."""
    return DeviceProfile(
        name,
        bf16,
        hbm_bandwidth,
        link if isinstance(link, Mapping) else dict.fromkeys(COLLECTIVES, link),
        10e-6,
        hbm,
        host_bandwidth=host_bandwidth,
        devices_per_host=per_host,
        dcn_bandwidth=dcn,
        overlap=True,
        fp8_flops=fp8,
        sources=sources,
        matmul_efficiency=matmul_curve[-1][1] if matmul_curve else None,
        matmul_curve=matmul_curve,
        link_efficiency=link_efficiency,
        dcn_efficiency=dcn_efficiency,
        memory=memory,
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
_TITAN_H100 = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton: 8 H100 per host on NVLink, "
    "'96GB HBM2e with 2.4 TB/sec peak memory bandwidth', 400 Gb/s RDMA per GPU, 'the default 500W power limit'; "
    "footnote 2: 'HBM2e-based SXM H100 with lower TDP, the actual peak TFLOPs number is between SXM and NVL')"
)
_H100_NVL = (
    "https://www.nvidia.com/en-us/data-center/h100/ (H100 NVL: bf16 1,671 TFLOPS and fp8 3,341 with sparsity, "
    "half dense)"
)
_DGX_H100 = (
    "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html (DGX H100: 8 GPUs, 8 single-port "
    "ConnectX-7 400 Gb/s for the compute fabric, one per GPU)"
)
_DGX_A100 = (
    "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html (DGX A100: 8 GPUs, 8 single-port "
    "ConnectX-6 200 Gb/s HDR InfiniBand for the compute fabric, one per GPU)"
)
_HOPPER_SHAPE = (
    "; no size sweep published for H100 / H200 was found: A100's fall-off is taken on the same sizes, scaled to "
    "the H100's large-GEMM 80.3% (Hopper's 132 SMs against A100's 108 need about sqrt(132/108) = 1.1x the side to "
    "fill a wave of tiles, so small GEMMs may fall off somewhat earlier than this)"
)
_MAMF = (
    "https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md (Maximum Achievable Matmul "
    "FLOPS, bf16 torch matmul, best shape: H100 SXM 794.5 of 989 TFLOPS, 80.3%, 'H200 is the same'; A100 SXM 271.2 "
    "of 312, 86.9%)"
)
KiB, MiB = 2**10, 2**20
_CUDA11_FIG6 = (
    "https://developer.nvidia.com/blog/cuda-11-features-revealed/ (Figure 6, 'Mixed-precision matrix multiply on "
    "A100 with cuBLAS', BF16 Tensor Core TFLOPS against m = n = k, read off the plot to about +-5 TFLOPS: 512 -> 28, "
    "1024 -> 88, 2048 -> 195, 4096 -> 260, 8192 -> 290; reproduced in stas00/ml-engineering "
    "compute/accelerator/README.md): the fall-off of small GEMMs, as a fraction of its 8192 value"
)
A100_GEMM_TFLOPS: tuple[tuple[float, float], ...] = ((512, 28), (1024, 88), (2048, 195), (4096, 260), (8192, 290))
"""cuBLAS BF16 TFLOP/s of an ``m = n = k`` GEMM on A100 (`_CUDA11_FIG6`): the shape of the matmul curves."""
_NCCL_H200 = (
    "https://github.com/stas00/ml-engineering/blob/master/network/benchmarks/results/all-reduce-8xH200.md (8x H200 "
    "SXM all_reduce bus bandwidth against payload, NCCL 2.27.7: 32 KiB 1.44 GB/s, 1 MiB 39.93, 16 MiB 219.89, "
    "256 MiB 436.15, 1 GiB 463.58, 16 GiB 482.26 with NVLS: the shape of every kind's curve; every kind's "
    "asymptote the ring's, 367.61 GB/s with NVLS off, 82% of 450 (all-gather 361.4 and reduce-scatter 362.9 at "
    "16 GiB): NVLS speeds up the all-reduce alone, which a cross-host all-reduce runs as a reduce-scatter and an "
    "all-gather in the host); NVIDIA/nccl-tests#212 (H100, 8 GPUs: 'NCCL can get an effective NVLink bandwidth of "
    "370GB/s', '~480GB/s' with NVLS)"
)
H200_ALL_REDUCE_BUSBW: tuple[tuple[float, float], ...] = tuple(
    (size, gbps * GB)
    for size, gbps in (
        (32 * KiB, 1.44),
        (256 * KiB, 11.74),
        (1 * MiB, 39.93),
        (2 * MiB, 64.53),
        (4 * MiB, 107.16),
        (8 * MiB, 155.53),
        (16 * MiB, 219.89),
        (32 * MiB, 275.84),
        (64 * MiB, 346.51),
        (128 * MiB, 401.93),
        (256 * MiB, 436.15),
        (512 * MiB, 450.29),
        (1 * GiB, 463.58),
        (4 * GiB, 473.10),
        (16 * GiB, 482.26),
    )
)
"""8x H200 NVLink 4 all_reduce bus bandwidth (bytes/s) against payload bytes (`_NCCL_H200`)."""
_NCCL_A100 = (
    "https://github.com/stas00/ml-engineering/blob/master/network/README.md#real-network-throughput (8x A100 "
    "nccl-tests all_reduce_perf -b 32k -e 16G -f 2 -g 8: busbw 1.31 GB/s at 32 KiB, 18.00 at 1 MiB, 106.16 at "
    "16 MiB, 194.07 at 256 MiB, 229.04 at 1 GiB, 234.89 at 16 GiB, 78% of NVLink 3's 300; no NVLS on A100, so its "
    "all-reduce is a ring, as fast as a ring all-gather or reduce-scatter: 367.2, 361.4, 362.9 GB/s on H200)"
)
A100_ALL_REDUCE_BUSBW: tuple[tuple[float, float], ...] = tuple(
    (size, gbps * GB)
    for size, gbps in (
        (32_768, 1.31),
        (1_048_576, 18.00),
        (4_194_304, 72.33),
        (16_777_216, 106.16),
        (67_108_864, 171.54),
        (268_435_456, 194.07),
        (1_073_741_824, 229.04),
        (4_294_967_296, 233.88),
        (17_179_869_184, 234.89),
    )
)
"""8x A100 NVLink 3 all_reduce bus bandwidth (bytes/s) against payload bytes (`_NCCL_A100`)."""
_NCCL_4_NODES = (
    "https://github.com/stas00/ml-engineering (network/README.md, 'Inter-node speed depends on intra-node speed': "
    "4 nodes x 8 B200, one 400 Gb/s EFA NIC (50 GB/s) per GPU, all_reduce; per-accelerator NIC rate = busbw "
    "(k-1)/(n-1) = busbw 3/31: 1 MiB 5.37 GB/s busbw, 16 MiB 6.24 GB/s per NIC (12.5% of 50), 256 MiB 22.17 "
    "(44.3%), 1 GiB 35.03 (70.1%), 4 GiB 377.34 busbw, 16 GiB 36.95 (73.9%)); each point's size here is the "
    "payload over the node's 8 GPUs, what each device sends across nodes. Measured on B200 / EFA, the one "
    "published multi-node curve found; taken for every GPU's NIC (NVIDIA/nccl-tests#290: 46-48 GB/s per 400 Gb/s "
    "NIC in a two-node ring, a simpler pattern)"
)
NIC_FRACTION_4_NODES: tuple[tuple[float, float], ...] = tuple(
    (payload / 8, per_nic / 50)
    for payload, per_nic in (
        (1 * MiB, 5.37 * 3 / 31),
        (16 * MiB, 6.24),
        (256 * MiB, 22.17),
        (1 * GiB, 35.03),
        (4 * GiB, 377.34 * 3 / 31),
        (16 * GiB, 36.95),
    )
)
"""Fraction of a 400 Gb/s NIC's 50 GB/s that a 4-node all_reduce's cross-node step reaches against the bytes
each GPU sends across nodes (`_NCCL_4_NODES`)."""
_JAX_V5E_MATMUL = (
    "https://docs.jax.dev/en/latest/pallas/tpu/matmul.html (jax-ml/jax docs/pallas/tpu/matmul.ipynb, 'XLA matmul' "
    "cell: jnp.matmul of bf16 m = k = n on TPU v5e against its 197 TFLOP/s, timed with timeit over 100 calls, "
    "Python dispatch included: 4096 -> 84.3307%, 8192 -> 92.2960%; its 1024 point, 9.1275% in 119 us, is the "
    "dispatch's, not the MXU's (the matmul takes 10.9 us at the peak) and is left out, so smaller matmuls are "
    "clamped at the 4096 point)"
)
V5E_XLA_GEMM: tuple[tuple[float, float], ...] = ((4096, 0.843307), (8192, 0.922960))
"""XLA's bf16 ``m = k = n`` matmul on TPU v5e as a fraction of its peak (`_JAX_V5E_MATMUL`)."""
_NO_TPU_CURVES = (
    "TPU: no published GEMM-size or collective message-size curve found for this chip (MaxText's MFUs are "
    "end-to-end, not GEMM rates): uncalibrated, matmuls at UNCALIBRATED_MATMUL_EFFICIENCY of the bf16 peak (the "
    "best large-GEMM fraction measured on any profile here, TPU v5e's), collectives on the alpha-beta line of the "
    "ICI / DCN spec"
)
_NO_TPU_LINK_CURVES = (
    "TPU: no published collective message-size curve found: collectives on the alpha-beta line of the ICI / DCN spec"
)
_HOPPER_SOURCES = (_MAMF, _CUDA11_FIG6 + _HOPPER_SHAPE, _NCCL_H200, _NCCL_4_NODES)
_H100_SXM = _spec(
    "H100",
    matmul_curve=_shape(A100_GEMM_TFLOPS, over=290 / 0.803),
    bf16=989e12,
    fp8=1979e12,
    hbm=80 * GiB,
    hbm_bandwidth=3.35e12,
    link=367.61 * GB,
    link_efficiency=_shape(H200_ALL_REDUCE_BUSBW),
    per_host=8,
    dcn=50 * GB,
    dcn_efficiency=NIC_FRACTION_4_NODES,
    host_bandwidth=55e9,
    sources=(_H100, _DGX_H100, *_HOPPER_SOURCES),
)
"""H100 SXM, the Hopper profile the variants (``"H200"``, ``"H100 HBM2e"``) change a few fields of."""
PROFILES: dict[str, DeviceProfile] = {
    # Per device: bf16 and fp8/int8 dense peak, HBM size and bandwidth, the intra-host link one way (NVLink's
    # bidirectional figure halved; TPU ICI per chip), the inter-host link (one 400 / 200 Gb/s NIC per GPU; TPU DCN
    # per chip), devices per host. GPU hosts of 8 with NVLink inside and InfiniBand across; a TPU slice is one ICI
    # domain (`openhosti_jax.planner.cluster` spans slices over DCN). Memory sizes quoted in GB are the GiB the
    # devices report (an H100's 80 GB is 80 GiB).
    "H100": _H100_SXM,
    # H200: H100's compute, links and curves, more and faster HBM
    "H200": dataclasses.replace(
        _H100_SXM,
        name="H200",
        memory_bytes=141 * GiB,
        memory_bandwidth=4.8e12,
        sources=(_H200, _DGX_H100, *_HOPPER_SOURCES),
    ),
    # Meta's Grand Teton H100 (torchtitan's benchmarks): SXM, 96 GB HBM2e at 2.4 TB/s, a 500 W power limit. Its
    # peak is "between SXM and NVL" and not published: the middle of the two, 912 TFLOP/s, +-8.5%
    "H100 HBM2e": dataclasses.replace(
        _H100_SXM,
        name="H100 HBM2e",
        peak_flops=(989e12 + 835e12) / 2,
        fp8_flops=(1979e12 + 1671e12) / 2,
        memory_bytes=96 * GiB,
        memory_bandwidth=2.4e12,
        sources=(_TITAN_H100, _H100_NVL, _H100, *_HOPPER_SOURCES),
    ),
    "A100": _spec(
        "A100",
        matmul_curve=_shape(A100_GEMM_TFLOPS, over=290 / 0.869),
        bf16=312e12,
        fp8=None,
        hbm=80 * GiB,
        hbm_bandwidth=2.039e12,
        link=234.89 * GB,
        link_efficiency=_shape(A100_ALL_REDUCE_BUSBW),
        per_host=8,
        dcn=25 * GB,
        dcn_efficiency=NIC_FRACTION_4_NODES,
        sources=(_A100, _DGX_A100, _MAMF, _CUDA11_FIG6, _NCCL_A100, _NCCL_4_NODES),
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
            _NO_TPU_CURVES,
        ),
    ),
    "TPU v5e": _spec(
        "TPU v5e",
        matmul_curve=V5E_XLA_GEMM,
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
            _JAX_V5E_MATMUL,
            _NO_TPU_LINK_CURVES,
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
            _NO_TPU_CURVES,
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
            _NO_TPU_CURVES,
        ),
        memory=XLA_TPU_V6E,
    ),
}
"""Spec-sheet profiles by device kind, each citing its sources (`DeviceProfile.sources`)."""

UNCALIBRATED_MATMUL_EFFICIENCY: float = max(p.achievable_matmul for p in PROFILES.values() if p.calibrated)
"""The fraction of its bf16 peak an uncalibrated device's matmuls are priced at (`DeviceProfile.calibrated`): the
highest large-GEMM fraction measured on any profile here (TPU v5e's XLA matmul, 92.3%; H100 80.3%, A100 86.9%).
A device nobody measured is assumed no faster than the fastest one measured: 100% of the peak is what no measured
chip reaches, and any lower figure would be a guess at that chip; so a prediction on it is an upper bound, and
says it is uncalibrated (`openhosti_jax.planner.predict.Prediction`)."""

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


def all_to_all_seconds(profile: DeviceProfile, nbytes: float, n: int) -> float:
    """Time of one all-to-all inside a host over groups of ``n`` devices, each holding a buffer of ``nbytes`` of which
    it sends one ``n``-th to every other device (a mixture-of-experts layer's token dispatch or return,
    `jax.lax.all_to_all`): each device sends and receives ``(n - 1) / n x nbytes`` (`bus_bytes`). A calibrated
    profile prices it on its own measured curve (``link_curve["all_to_all"]``: XLA's CPU all-to-all runs several
    times slower than its all-gather of the same bytes); a spec-sheet profile, which has none, as the all-gather
    whose full buffer is ``nbytes``: the same bus bytes over the same links (`DeviceProfile.link_seconds`).

    >>> round(all_to_all_seconds(PROFILES["A100"], 2**24, 8) * 1e6, 1)  # 16 MiB per device over 8 A100s
    138.3
    """
    if "all_to_all" in profile.link_curve:
        return profile.collective_seconds("all_to_all", nbytes, n)
    return profile.link_seconds("all_gather", nbytes, n)


def bus_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device moves in a collective of ``kind`` over ``n`` devices on a full buffer of ``nbytes``."""
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes
