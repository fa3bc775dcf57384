"""Calibration: measure a `DeviceProfile` for devices with no spec sheet (CPU, any unknown kind), and choose the
profile for a device set.

`calibrate` times, on every device at once (so shared cores and caches are accounted for): a matmul; in-place
elementwise streaming over working sets of 512 KiB .. 32 MiB (`DeviceProfile.memory_curve`: small steps stream from
the caches); and all-reduce / all-gather / reduce-scatter / all-to-all at several sizes (16 KiB .. 8 MiB, and on up
to the largest collective the model needs, `calibration_sizes`; alternated, medians) over every group size. They give
each collective's measured curve (`DeviceProfile.link_curve`), and over all devices the first three's latency (alpha)
and bandwidth (beta) by a least-squares fit (`fit_alpha_beta`).

Example:
    >>> from openhosti_jax.planner.calibrate import device_profile
    >>> device_profile(override="H200").memory_bytes // 2**30
    141
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PlanningError
from openhosti_jax.mesh.barrier import gathered
from openhosti_jax.planner import profile_cache
from openhosti_jax.planner.profiles import (
    COLLECTIVES,
    KIND_ALIASES,
    MEASURED,
    PROFILES,
    XLA_CPU,
    XLA_TPU,
    DeviceProfile,
    bus_bytes,
)

MEMORY_SIZES: tuple[int, ...] = (2**19, 2**21, 2**23, 2**25)
"""Working sets per device (512 KiB .. 32 MiB) at which `calibrate` times elementwise streaming."""

CALIBRATION_SIZES: tuple[int, ...] = (2**14, 2**16, 2**18, 2**20, 2**21, 2**23)
"""Per-device buffer bytes (16 KiB .. 8 MiB) at which `calibrate` times each collective."""
MAX_CALIBRATION_BYTES = 2**26
"""The largest per-device buffer `calibration_sizes` adds (64 MiB); bigger collectives extrapolate."""


def calibration_sizes(max_bytes: int | None = None) -> tuple[int, ...]:
    """`CALIBRATION_SIZES`, then sqrt(2) steps until one reaches ``max_bytes`` (at most
    `MAX_CALIBRATION_BYTES`): the sizes at which to time collectives so that a model whose largest collective
    moves ``max_bytes`` per device is priced by interpolation, not extrapolation. The steps are fine because
    a curve can bend anywhere (a cache or a transport protocol switching), and a straight line over a 4x step
    misprices the sizes between.

    Example:
        >>> [round(s / 2**20, 1) for s in calibration_sizes(20 * 2**20)[5:]]
        [8.0, 11.3, 16.0, 22.6]
    """
    sizes = list(CALIBRATION_SIZES)
    while max_bytes is not None and sizes[-1] < min(max_bytes, MAX_CALIBRATION_BYTES):
        step = len(sizes) - len(CALIBRATION_SIZES) + 1
        sizes.append(min(round(CALIBRATION_SIZES[-1] * 2 ** (step / 2)), MAX_CALIBRATION_BYTES))
    return tuple(sizes)


def alternated_medians(
    fns: Sequence[Callable[[], object]], reps: int, sync: Callable[[], object] | None = None
) -> list[float]:
    """Median seconds of each of ``fns``, timed in ``reps`` alternating rounds (load drifts hit all alike).

    ``sync`` (untimed, before each timing) lines processes up, so that a collective's time is not its wait for
    a process still busy with the previous kernel.
    """
    for fn in fns:
        jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            if sync is not None:
                jax.block_until_ready(sync())
            t = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t)
    return [float(np.median(ts)) for ts in times]


def fit_alpha_beta(bus_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) of ``seconds ~ alpha + bus_bytes / bandwidth``.

    Ordinary least squares on the times (so the large sizes, whose times are least disturbed by scheduling
    noise, set the bandwidth). A negative intercept is refitted through the origin (alpha = 0). A non-positive
    slope (time not growing with size: noise or load; numerically: the size term is under 1% of the largest
    size's time) is rejected: the bandwidth of the largest size is used, with alpha 0.

    Example:
        >>> a, bw = fit_alpha_beta([1e6, 2e6, 4e6], [2e-3, 3e-3, 5e-3])
        >>> round(a * 1e3, 3), round(bw / 1e9, 3)
        (1.0, 1.0)
    """
    x, t = np.asarray(bus_bytes, np.float64), np.asarray(seconds, np.float64)
    if x.shape != t.shape or x.size < 2 or np.unique(x).size < 2 or not (t > 0).all():
        raise PlanningError(
            f"alpha-beta fit needs >= 2 distinct sizes with positive times; got sizes {x.tolist()}, "
            f"seconds {t.tolist()}; time each collective at several sizes"
        )
    slope, alpha = np.polyfit(x, t, 1)
    if alpha < 0:
        alpha, slope = 0.0, float(np.dot(x, t) / np.dot(x, x))
    if not slope * x.max() > 0.01 * t.max():
        i = int(np.argmax(x))
        return 0.0, float(x[i] / t[i])
    return float(alpha), float(1.0 / slope)


def _agreed_seconds(seconds: Sequence[float]) -> list[float]:
    """Per entry, the slowest process's time, so that every process builds the same profile (and plan)."""
    if jax.process_count() == 1:
        return list(seconds)
    gathered = multihost_utils.process_allgather(np.asarray(seconds, np.float64))
    return [float(v) for v in np.max(np.asarray(gathered).reshape(jax.process_count(), -1), axis=0)]


def calibrate(
    devices: Sequence[jax.Device] | None = None,
    *,
    reps: int = 5,
    sizes: Sequence[int] = CALIBRATION_SIZES,
) -> DeviceProfile:
    """Measure a profile for ``devices`` (default: all) by timing small kernels on all of them at once.

    Each collective is timed at every per-device buffer size in ``sizes`` (``reps`` alternating rounds,
    medians) over every group size that divides the device count (consecutive devices, all groups at once, as
    the inner axes of a mesh run them), kept as measured curves, and over all devices fitted by
    `fit_alpha_beta`. With devices in several processes the collectives cross the
    process boundary, so the fit prices that link; every process takes the slowest process's timings and so
    returns the same profile (call it on all processes, like any collective).
    """
    devices = list(devices or jax.devices())
    n = len(devices)
    if len(set(sizes)) < 2 or min(sizes) < 4 * n:
        raise PlanningError(
            f"calibrate needs >= 2 distinct sizes of >= {4 * n} bytes; got {list(sizes)}; "
            f"pass e.g. sizes={CALIBRATION_SIZES}"
        )

    def on_all(f: Callable, *shapes: tuple[int, ...], group: int = n) -> Callable[[], object]:
        """``f`` on every device at once, its collectives over consecutive groups of ``group`` devices."""
        mesh = Mesh(
            np.asarray(devices, dtype=object).reshape(n // group, group),
            ("r", "d"),
            axis_types=(AxisType.Explicit,) * 2,
        )
        sharded = NamedSharding(mesh, P(("r", "d")))
        local = [d for d in devices if d.process_index == jax.process_index()]
        xs = [
            jax.make_array_from_process_local_data(sharded, np.ones((len(local), *s), np.float32), (n, *s))
            for s in shapes
        ]
        spec = P(("r", "d"))
        g = jax.jit(jax.shard_map(lambda *a: f(*(x[0] for x in a))[None], mesh=mesh, in_specs=spec, out_specs=spec))
        return lambda: g(*xs)

    m = 512
    kernels = [
        on_all(lambda a: a + 1.0, (1,)),  # the launch: a program that does (almost) nothing
        on_all(lambda a, b: a @ b, (m, m), (m, m)),
    ]
    kernels += [on_all(_stream(stream_length(ws)), (ws // 8,), (ws // 8,)) for ws in MEMORY_SIZES]
    groups = [g for g in range(2, n + 1) if n % g == 0]
    sizes = sorted({s // (4 * n) * 4 * n for s in sizes})
    timed = [(kind, g) for kind in MEASURED for g in groups]
    for kind, g in timed:
        kernels += [on_all(_chain(kind, chain_length(s)), (_input_bytes(kind, s, g) // 4,), group=g) for s in sizes]
    sync = on_all(lambda a: jax.lax.psum(a, "d"), (1,)) if jax.process_count() > 1 else None
    raw = _agreed_seconds(alternated_medians(kernels, reps, sync))
    launch = raw[0]
    secs = [max(t - launch, 1e-7) for t in raw[1:]]  # each kernel's own time, as one op of a step
    flops = 2 * m**3 / secs[0]
    streamed = [
        1.5 * ws * stream_length(ws) / t for ws, t in zip(MEMORY_SIZES, secs[1 : 1 + len(MEMORY_SIZES)], strict=True)
    ]
    # a smaller working set never streams slower (only dispatch and noise make it look so)
    memory = tuple(zip(map(float, MEMORY_SIZES), np.maximum.accumulate(streamed[::-1])[::-1].tolist(), strict=True))
    mem_bw = memory[-1][1]
    name, native_rs = f"{devices[0].platform} (measured)", devices[0].platform != "cpu"
    if n == 1:
        return DeviceProfile(
            name,
            flops,
            mem_bw,
            dict.fromkeys(COLLECTIVES, 1e12),
            0.0,
            memory_curve=memory,
            launch_seconds=launch,
            native_reduce_scatter=native_rs,
            memory=XLA_TPU if native_rs else XLA_CPU,
            matmul_efficiency=1.0,  # the peak is the measured matmul rate
        )
    bandwidth, latencies = {}, []
    curves: dict[str, dict[int, tuple[tuple[float, float], ...]]] = {kind: {} for kind in MEASURED}
    for i, (kind, g) in enumerate(timed):
        first = 1 + len(MEMORY_SIZES) + i * len(sizes)
        chains = secs[first : first + len(sizes)]
        seconds = [t / chain_length(s) for t, s in zip(chains, sizes, strict=True)]
        bus = [bus_bytes(kind, s, g) for s in sizes]
        # a smaller buffer never takes longer: interference only adds time, so a small size timed above a larger
        # one is noise (clipping from above keeps one slow sample from raising every larger size)
        monotone = np.minimum.accumulate(np.asarray(seconds)[::-1])[::-1]
        curves[kind][g] = tuple(zip(bus, monotone.tolist(), strict=True))
        if g == n and kind in COLLECTIVES:  # the alpha-beta summary describes the whole device set
            alpha, bw = fit_alpha_beta(bus, seconds)
            bandwidth[kind] = bw
            latencies.append(alpha)
    return DeviceProfile(
        name,
        flops,
        mem_bw,
        bandwidth,
        float(np.median(latencies)),
        link_curve=curves,
        memory_curve=memory,
        launch_seconds=launch,
        native_reduce_scatter=native_rs,
        memory=XLA_TPU if native_rs else XLA_CPU,
        matmul_efficiency=1.0,  # the peak is the measured matmul rate
    )


def _input_bytes(kind: str, nbytes: int, n: int) -> int:
    """Per-device input bytes of a collective whose full buffer is ``nbytes`` (an all-gather's is 1/n of it)."""
    return nbytes // n if kind == "all_gather" else nbytes


CHAIN_BYTES = 2**19
"""Buffers smaller than this are timed as a chain of `chain_length` dependent collectives in one program."""


def chain_length(nbytes: int) -> int:
    """Collectives a calibration chains at ``nbytes`` per device: CHAIN_BYTES // nbytes, 1 .. 16.

    A program's lone collective also waits for the devices' start skew, which a step's later collectives do not,
    so a small one timed alone looks several times slower than inside a step. Chaining small sizes prices the op
    as a step sees it; large ones dwarf the skew.

    Example:
        >>> [chain_length(n) for n in (2**14, 2**16, 2**18, 2**20)]
        [16, 8, 2, 1]
    """
    return int(np.clip(CHAIN_BYTES // nbytes, 1, 16))


def _chain(kind: str, length: int) -> Callable[[jax.Array], jax.Array]:
    """``length`` dependent collectives of ``kind`` over mesh axis ``"d"``; inside a chain an all-gather's result
    is cut, and a reduce-scatter's tiled, back to its input's shape (one small copy)."""

    def f(a: jax.Array) -> jax.Array:
        for i in range(length):
            last = i == length - 1
            if kind == "all_reduce":
                a = jax.lax.psum(a, "d")
            elif kind == "all_to_all":
                a = jax.lax.all_to_all(a, "d", 0, 0, tiled=True)
            elif kind == "all_gather":
                out = jax.lax.all_gather(a, "d", tiled=True)
                a = out if last else out[: a.shape[0]]
            else:
                out = jax.lax.psum_scatter(a, "d", tiled=True)
                a = out if last else jnp.tile(out, a.shape[0] // out.shape[0])
        return a

    return f


def stream_length(working_set: int) -> int:
    """Iterations of the streaming kernel timed at ``working_set`` bytes per device: ~16 MiB of traffic per
    device (each iteration reads two buffers and writes one, 1.5x the working set), at most 64, and at least 4,
    because the loop's first write fills a fresh buffer (page faults) where a step's donated state does not."""
    return int(np.clip(2**24 // working_set, 4, 64))


def _stream(length: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``a <- a * c + b``, ``length`` times in a loop: elementwise traffic over a working set of ``a`` and ``b``
    that stays in place, as a step's donated state and reused temporaries do."""

    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, length, lambda _, x: x * 1.0001 + b, a)

    return f


@functools.cache
def _calibrated(device_ids: tuple[int, ...], sizes: tuple[int, ...], recalibrate: bool) -> DeviceProfile:
    """The measured profile of these devices: from this machine's cache (`openhosti_jax.planner.profile_cache`)
    where every process holds the same one, else calibrated now on all processes and stored."""
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for i in device_ids]
    key = profile_cache.profile_key(devices, sizes)
    cached = None if recalibrate or profile_cache.recalibrate_requested() else profile_cache.load(key)
    digest = profile_cache.digest(cached) if cached is not None else ""
    held = gathered(f"profile-{key}", digest)  # a calibration is collective: measure on all or on none
    if cached is not None and len(set(held)) == 1:
        return cached
    profile = calibrate(devices, sizes=sizes)
    profile_cache.store(profile, key)
    return profile


def device_profile(
    devices: Sequence[jax.Device] | None = None,
    override: DeviceProfile | str | None = None,
    *,
    max_bytes: int | None = None,
    recalibrate: bool = False,
) -> DeviceProfile:
    """The profile for ``devices``: ``override`` (a profile or a `PROFILES` key), the spec sheet for a known
    accelerator kind, else a run-time calibration up to ``max_bytes`` per device (`calibration_sizes`; pass the
    largest collective the model will issue, e.g. its gradient bytes). A calibration is kept in memory and on disk
    per machine and backend (`openhosti_jax.planner.profile_cache`): a later run reads it instead of measuring,
    unless ``recalibrate`` (or ``OPENHOSTI_RECALIBRATE=1``)."""
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
    for alias, name in KIND_ALIASES.items():
        if alias in kind:
            return PROFILES[name]
    return _calibrated(tuple(d.id for d in devices), calibration_sizes(max_bytes), recalibrate)
