"""Device profiles and calibration: alpha-beta formulas, measured link and memory curves."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import PlanningError
from openhosti_jax.planner.calibrate import (
    CALIBRATION_SIZES,
    MAX_CALIBRATION_BYTES,
    alternated_medians,
    calibrate,
    calibration_sizes,
)
from openhosti_jax.planner.profiles import PROFILES


def test_alpha_beta_formulas():
    p = PROFILES["H100"]
    n, b = 8, 2**30
    bw = p.link_bandwidth["all_reduce"]
    assert p.collective_seconds("all_reduce", b, n) == p.link_latency + 2 * (n - 1) / n * b / bw
    assert p.collective_seconds("all_gather", b, n) == p.link_latency + (n - 1) / n * b / bw
    assert p.collective_seconds("reduce_scatter", b, 1) == 0.0


def test_measured_curve_interpolates_and_extends_its_end_segments():
    """A calibrated profile follows its measured points (bandwidth halving past 8 MiB), not one line, on the
    curve of the nearest measured group size."""
    mib = 2**20
    curve = ((1 * mib, 1e-3), (8 * mib, 8e-3), (32 * mib, 56e-3))  # 1 GB/s, then 0.5 GB/s
    pairs = ((1 * mib, 0.5e-3), (8 * mib, 4e-3))  # groups of 2 meet twice as fast
    p = dataclasses.replace(PROFILES["H100"], link_curve={"all_gather": {8: curve, 2: pairs}})
    n = 8  # all-gather bus bytes = (n-1)/n * bytes
    at = lambda bus, n=n: p.collective_seconds("all_gather", bus * n / (n - 1), n)
    assert at(8 * mib) == pytest.approx(8e-3)
    assert at(20 * mib) == pytest.approx(8e-3 + 12 * mib * 48e-3 / (24 * mib))  # on the 0.5 GB/s segment
    assert at(64 * mib) == pytest.approx(56e-3 + 32 * mib * 48e-3 / (24 * mib))  # last segment extended
    assert at(1024) == pytest.approx(1e-3)  # never below the smallest measured time
    assert at(8 * mib, 2) == pytest.approx(4e-3)  # its own group's curve
    assert at(8 * mib, 16) == pytest.approx(8e-3)  # the nearest measured group: 8
    assert at(8 * mib, 4) == pytest.approx(8e-3)  # halfway (in log) between 2 and 8: the larger, not to flatter
    # kinds without a curve keep the alpha-beta line
    bw = p.link_bandwidth["all_reduce"]
    assert p.collective_seconds("all_reduce", mib, 8) == p.link_latency + 2 * 7 / 8 * mib / bw
    with pytest.raises(PlanningError, match="link_curve"):
        dataclasses.replace(p, link_curve={"all_gather": {8: ((2.0, 1.0), (1.0, 2.0))}})
    with pytest.raises(PlanningError, match="group size"):
        dataclasses.replace(p, link_curve={"all_gather": {1: curve}})
    with pytest.raises(PlanningError, match="link_curve"):
        dataclasses.replace(p, link_curve={"all_gather": curve})


def test_memory_curve_prices_a_working_set_at_its_own_bandwidth():
    """Elementwise traffic streams at the bandwidth measured for the step's working set: log-scale
    interpolation between points, clamped at both ends; without a curve, the flat memory bandwidth."""
    curve = ((1e6, 10e9), (1e8, 2e9))
    p = dataclasses.replace(PROFILES["H100"], memory_curve=curve)
    assert p.memory_seconds(1e9, 1e6) == pytest.approx(0.1)
    assert p.memory_seconds(1e9, 1e7) == pytest.approx(1 / 6)  # half way in log scale: 6 GB/s
    assert p.memory_seconds(1e9, 1e3) == pytest.approx(0.1) and p.memory_seconds(1e9, 1e12) == pytest.approx(0.5)
    assert PROFILES["H100"].memory_seconds(3.35e12, 1e3) == pytest.approx(1.0)
    for bad in (((1e6, 2e9), (1e8, 10e9)), ((1e6, 2e9),), ((1e8, 2e9), (1e6, 1e9)), ((0.0, 2e9), (1e6, 1e9))):
        with pytest.raises(PlanningError, match="memory_curve"):
            dataclasses.replace(p, memory_curve=bad)


@pytest.mark.timeout(120)
def test_calibrated_memory_curve_prices_a_cache_resident_loop():
    """``x <- x/2 + b*b`` over a 1 MiB working set per device (between two calibrated sizes; all 8 devices at
    once, 32 times in a loop) runs at cache speed: the calibrated curve prices it closer to its measured time
    than the large-buffer bandwidth. (An Adam loop is not used: its several fusions per iteration cost dispatch
    the memory term does not model, ~50 us each here.)"""
    devices = jax.devices()
    p = calibrate(devices, reps=5, sizes=(2**16, 2**18))
    n, k, loops = len(devices), 2**17, 32  # x and b: 8 bytes per element
    mesh = Mesh(np.asarray(devices, dtype=object), ("d",), axis_types=(AxisType.Explicit,))

    def loop(x, b):
        return jax.lax.fori_loop(0, loops, lambda _, x: 0.5 * x + b * b, x)

    f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    xs = [jax.device_put(np.ones((n * k,), np.float32), NamedSharding(mesh, P("d"))) for _ in range(2)]
    (measured,) = alternated_medians([lambda: f(*xs)], 11)
    traffic = 3 * 4 * k  # reads x, b; writes x
    curve = p.launch_seconds + loops * p.memory_seconds(traffic, 8 * k)
    flat = p.launch_seconds + loops * traffic / p.memory_bandwidth
    assert p.memory_curve[0][1] > p.memory_bandwidth
    assert abs(curve - measured) < abs(flat - measured), (measured, curve, flat)


def test_calibration_sizes_reach_the_largest_collective():
    assert calibration_sizes() == CALIBRATION_SIZES
    assert calibration_sizes(2**20) == CALIBRATION_SIZES
    assert [s / 2**20 for s in calibration_sizes(32 * 2**20)[-3:]] == pytest.approx([16, 2**4.5, 32])  # sqrt(2) steps
    assert calibration_sizes(2**40)[-1] == MAX_CALIBRATION_BYTES


@pytest.mark.timeout(120)
def test_calibration_prices_a_collective_as_one_op_inside_a_step():
    """Each calibration kernel runs as its own program; its launch is measured and subtracted, so that K
    collectives inside one step cost one launch + K collectives (not K launches)."""
    devices = jax.devices()
    p = calibrate(devices, reps=9, sizes=(2**16, 2**18))
    assert p.launch_seconds > 0
    k, n, nbytes = 16, len(devices), 2**18
    mesh = Mesh(np.asarray(devices, dtype=object), ("d",), axis_types=(AxisType.Explicit,))

    def chain(a):
        for _ in range(k):
            a = jax.lax.psum(a, "d")  # ones: 8**16 stays finite
        return a

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jax.device_put(np.ones((n, nbytes // 4), np.float32), NamedSharding(mesh, P("d")))
    (measured,) = alternated_medians([lambda: f(x)], 15)
    per_op = p.collective_seconds("all_reduce", nbytes, n)
    in_step, per_program = p.launch_seconds + k * per_op, k * (per_op + p.launch_seconds)
    assert abs(in_step - measured) < abs(per_program - measured), (measured, in_step, per_program)


@pytest.mark.timeout(120)
def test_calibration_prices_a_small_group_on_its_own_curve():
    """Collectives over pairs (a tensor axis of 2, all pairs at once) are timed as such: K chained pair
    all-reduces in one step cost what the pairs' curve says, which is less than the all-device curve's price."""
    devices = jax.devices()
    n, k, nbytes = len(devices), 12, 2**15  # between the calibrated sizes
    p = calibrate(devices, reps=7, sizes=(2**14, 2**16))
    assert set(p.link_curve["all_reduce"]) == {g for g in range(2, n + 1) if n % g == 0}
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(n // 2, 2), ("r", "d"), axis_types=(AxisType.Explicit,) * 2)

    def chain(a):
        for _ in range(k):
            a = jax.lax.psum(a, "d")  # ones: 8**16 stays finite
        return a

    spec = P(("r", "d"))
    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(np.ones((n, nbytes // 4), np.float32), NamedSharding(mesh, spec))
    (measured,) = alternated_medians([lambda: f(x)], 15)
    pairs = p.launch_seconds + k * p.collective_seconds("all_reduce", nbytes, 2)
    as_if_all = p.launch_seconds + k * p.link_curve["all_reduce"][n][0][1]
    assert pairs < as_if_all
    assert abs(pairs - measured) < abs(as_if_all - measured), (measured, pairs, as_if_all)


def test_a_measured_profile_is_read_back_from_disk_by_a_later_run(tmp_path, monkeypatch):
    """The second plan of a machine reads the first one's calibration instead of measuring again."""
    import openhosti_jax.planner.calibrate as cal

    monkeypatch.setenv("OPENHOSTI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OPENHOSTI_RECALIBRATE", raising=False)
    measured = calibrate(jax.devices(), reps=1, sizes=(2**14, 2**16))
    runs = []

    def counted(devices, *, sizes):
        runs.append(len(devices))
        return measured

    monkeypatch.setattr(cal, "calibrate", counted)
    cal._calibrated.cache_clear()
    first = cal.device_profile(jax.devices())
    assert runs == [8] and first == measured
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    cal._calibrated.cache_clear()  # a new process: nothing in memory
    assert cal.device_profile(jax.devices()) == measured and runs == [8]  # read, exactly equal, not measured
    cal._calibrated.cache_clear()
    cal.device_profile(jax.devices(), recalibrate=True)
    cal._calibrated.cache_clear()
    monkeypatch.setenv("OPENHOSTI_RECALIBRATE", "1")
    cal.device_profile(jax.devices())
    assert runs == [8, 8, 8]
    cal._calibrated.cache_clear()


def test_a_damaged_or_foreign_profile_file_is_measured_again(tmp_path):
    from openhosti_jax.planner import profile_cache

    key = profile_cache.profile_key(jax.devices(), CALIBRATION_SIZES)
    assert key != profile_cache.profile_key(jax.devices()[:4], CALIBRATION_SIZES)
    assert key != profile_cache.profile_key(jax.devices(), CALIBRATION_SIZES[:-1])
    path = profile_cache.store(PROFILES["H100"], key, tmp_path)
    assert profile_cache.load(key, tmp_path) == PROFILES["H100"]
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # a torn write
    assert profile_cache.load(key, tmp_path) is None
    path.write_text(text.replace(key, "another-key"))  # a file copied from another machine's key
    assert profile_cache.load(key, tmp_path) is None
    assert list(path.parent.glob("*.tmp")) == []
