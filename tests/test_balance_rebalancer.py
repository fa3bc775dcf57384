"""Rebalancer and Monitor against closed forms and brute force on simulated speeds."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openhosti_jax.balance import Monitor, Rebalancer, describe_assignment
from openhosti_jax.errors import BalanceError


def simulate(rb, monitor, true_spmb, steps, noise, seed=0, start=None):
    """Closed loop: a device's local time is counts * seconds-per-microbatch * (1 + noise)."""
    r = np.random.default_rng(seed)
    counts = start or rb.even()
    history = [counts]
    for _ in range(steps):
        secs = np.asarray(counts) * true_spmb * (1 + noise * r.uniform(-1, 1, len(counts)))
        monitor.observe(secs, counts)
        counts = rb.update(counts, monitor.speeds())
        history.append(counts)
    return counts, history


@pytest.mark.parametrize(
    "spmb", [(1.0, 1.0, 1.0, 2.0), (1.0, 1.0, 1.0, 4.0), (1.0, 1.5, 2.0, 3.0), (1, 1, 1, 1, 1, 1, 1, 8.0)]
)
def test_converges_within_one_microbatch_of_the_ideal(spmb):
    spmb = np.asarray(spmb)
    size, total = len(spmb), 7 * len(spmb)
    rb = Rebalancer(total=total, size=size, capacity=total, hysteresis=0.02)
    counts, _ = simulate(rb, Monitor(size, every=1), spmb, steps=10, noise=0.01)
    ideal = total * (1 / spmb) / (1 / spmb).sum()
    assert sum(counts) == total
    assert np.abs(np.asarray(counts) - ideal).max() < 1.0, (counts, ideal)


def test_equal_speeds_do_not_move_and_noise_does_not_oscillate():
    rb = Rebalancer(total=32, size=4, capacity=16)
    counts, hist = simulate(rb, Monitor(4, every=1), np.ones(4), steps=30, noise=0.02)
    assert set(hist) == {(8, 8, 8, 8)}
    _, hist = simulate(rb, Monitor(4, every=1), np.array([1.0, 1, 1, 2]), steps=30, noise=0.03, seed=1)
    changes = sum(a != b for a, b in itertools.pairwise(hist))
    assert changes <= 3, hist


def brute_force_min_time(total, speeds, lo, hi):
    best = None
    for c in itertools.product(*[range(a, b + 1) for a, b in zip(lo, hi, strict=True)]):
        if sum(c) == total:
            t = max(ci / s for ci, s in zip(c, speeds, strict=True) if s > 0)
            best = t if best is None else min(best, t)
    return best


@settings(max_examples=60, deadline=None)
@given(
    speeds=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=4),
    extra=st.integers(0, 10),
    cap_extra=st.integers(0, 6),
)
def test_assign_respects_bounds_and_is_near_optimal(speeds, extra, cap_extra):
    size = len(speeds)
    total = size + extra
    capacity = max(1, -(-total // size)) + cap_extra
    rb = Rebalancer(total=total, size=size, capacity=capacity)
    counts = rb.assign(speeds)
    assert sum(counts) == total and all(1 <= c <= capacity for c in counts)
    ideal = rb.ideal(speeds)
    assert np.isclose(ideal.sum(), total)
    # the brute-force optimum of the predicted step time, for floor 1 and for floor 0 (a device may get nothing)
    best = brute_force_min_time(total, speeds, [1] * size, [capacity] * size)
    assert rb.predicted_time(counts, speeds) <= best * (1 + 1e-9)
    rb0 = Rebalancer(total=total, size=size, capacity=capacity, floor=0)
    best0 = brute_force_min_time(total, speeds, [0] * size, [capacity] * size)
    assert rb0.predicted_time(rb0.assign(speeds), speeds) <= best0 * (1 + 1e-9)
    assert rb.assign(list(speeds)) == counts  # deterministic


def test_failed_devices_get_nothing_and_others_at_least_one():
    rb = Rebalancer(total=12, size=4, capacity=10)
    assert rb.assign([1.0, 1.0, 100.0, 1e-3], failed=[1]) == (1, 0, 10, 1)
    assert rb.update((3, 3, 3, 3), [1.0] * 4, failed=[2]) == (4, 4, 0, 4)
    with pytest.raises(BalanceError, match="cannot place"):
        Rebalancer(total=12, size=4, capacity=4).assign([1.0] * 4, failed=[0, 1])
    with pytest.raises(BalanceError, match="finite positive speeds"):
        rb.assign([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(BalanceError, match="raise capacity"):
        Rebalancer(total=10, size=4, capacity=2)


def test_monitor_ignores_one_noisy_sample_and_follows_a_real_change():
    m = Monitor(3, every=2, alpha=0.5)
    for _ in range(4):
        m.observe(np.array([2.0, 2.0, 2.0]), (2, 2, 2))
    m.observe(np.array([200.0, 2.0, 2.0]), (2, 2, 2))  # one spike
    np.testing.assert_allclose(m.seconds_per_microbatch, [1.0, 1.0, 1.0])
    for _ in range(6):  # device 1 really becomes 3x slower
        m.observe(np.array([2.0, 6.0, 2.0]), (2, 2, 2))
    np.testing.assert_allclose(m.seconds_per_microbatch, [1.0, 3.0, 1.0], rtol=0.05)
    assert m.host_seconds([0, 0, 1]) == {0: 6.0, 1: 2.0}
    assert [m.should_probe(s) for s in range(4)] == [True, False, True, False]
    with pytest.raises(BalanceError, match="missing"):
        Monitor(2).speeds()


def test_describe_assignment():
    assert describe_assignment((8, 8, 8, 8)) is None
    assert describe_assignment((9, 9, 8, 2)) == "mb/device 9/9/8/2"
