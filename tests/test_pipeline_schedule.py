"""Schedules and the simulator against closed forms; tick tables against the simulator."""

import numpy as np
import pytest

from openhosti_jax.errors import PipelineError
from openhosti_jax.pipeline import (
    Action,
    Schedule,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
    simulate,
    tick_table,
)
from openhosti_jax.pipeline.ticks import BACKWARD, FIELDS, FORWARD


@pytest.mark.parametrize("s", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 32])
def test_gpipe_bubble_equals_formula(s, m):
    r = simulate(gpipe(s, m), forward_times=1.5, backward_times=3.0)
    assert r.bubble_fraction == pytest.approx((s - 1) / (m + s - 1), abs=1e-12)
    assert r.makespan == pytest.approx((m + s - 1) * 4.5)
    assert r.peak_in_flight == (m,) * s


@pytest.mark.parametrize("s,m", [(2, 2), (4, 8), (4, 16), (8, 8), (3, 7)])
def test_1f1b_in_flight_at_most_s_and_same_bubble(s, m):
    r = simulate(one_f_one_b(s, m), 1.0, 2.0)
    assert r.peak_in_flight == tuple(min(m, s - d) for d in range(s))
    assert max(r.peak_in_flight) <= s
    assert r.bubble_fraction == pytest.approx((s - 1) / (m + s - 1))
    assert simulate(gpipe(s, m), 1.0, 2.0).peak_in_flight == (m,) * s


@pytest.mark.parametrize("s,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaved_shrinks_bubble_by_v(s, m, v):
    r = simulate(interleaved_one_f_one_b(s, m, v), 1.0 / v, 2.0 / v)
    # Megatron-LM: bubble time (S-1)(tf+tb)/V against M(tf+tb) of work
    ideal = (s - 1) / v / (m + (s - 1) / v)
    assert r.bubble_fraction == pytest.approx(ideal, rel=1e-9)
    assert r.bubble_fraction < simulate(one_f_one_b(s, m), 1.0, 2.0).bubble_fraction


def test_unequal_stage_times_bottleneck():
    # steady state runs at the slowest stage: makespan = sum of one pass + (M-1) * slowest
    times = [1.0, 3.0, 1.0, 1.0]
    r = simulate(gpipe(4, 6), times, [0.0] * 4)
    assert r.makespan == pytest.approx(sum(times) + 5 * 3.0)


def test_invalid_schedules_raise():
    with pytest.raises(PipelineError, match="before its forward"):
        Schedule("bad", 1, 1, 1, ((Action("B", 0), Action("F", 0)),))
    with pytest.raises(PipelineError, match="expected 2 actions"):
        Schedule("bad", 1, 1, 1, ((Action("F", 0),),))
    with pytest.raises(PipelineError, match="divisible"):
        interleaved_one_f_one_b(4, 6, 2)
    with pytest.raises(PipelineError, match="unknown schedule"):
        make_schedule("zb", 2, 2)
    # stage 1 starts with F1, which stage 0 sends only after B0, which needs stage 1's B0: a cycle
    f, b = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    dead = Schedule("dead", 2, 2, 1, ((f(0), b(0), f(1), b(1)), (f(1), f(0), b(0), b(1))))
    with pytest.raises(PipelineError, match="deadlocks"):
        simulate(dead, 1.0)


@pytest.mark.parametrize(
    "schedule", [gpipe(4, 8), one_f_one_b(4, 8), interleaved_one_f_one_b(2, 4, 2), one_f_one_b(1, 3)]
)
def test_tick_table_replays_schedule(schedule):
    t = tick_table(schedule)
    sim = simulate(schedule, 1.0, 1.0)
    assert t.num_ticks == sim.makespan
    f = {name: i for i, name in enumerate(FIELDS)}
    for d in range(schedule.num_stages):
        ops = t.table[:, d]
        run = [(int(r[f["op"]]), int(r[f["chunk"]]), int(r[f["microbatch"]])) for r in ops if r[f["op"]]]
        want = [
            (FORWARD if a.kind == "F" else BACKWARD, schedule.chunk(d, a), a.microbatch) for a in schedule.actions[d]
        ]
        assert run == want
    # replay the buffers: every read finds the value that was written for that (chunk, microbatch)
    s, n_chunks = schedule.num_stages, schedule.num_chunks
    acts = np.full((s, t.num_act_slots + 1, 2), -1)
    grads = np.full((s, t.num_grad_slots + 1, 2), -1)
    for row in t.table:
        sends = []
        for d in range(s):
            op, c, m, a_slot, g_slot = (int(row[d, k]) for k in range(5))
            if op and c > 0:
                assert tuple(acts[d, a_slot]) == (c, m)
            if op == BACKWARD and c < n_chunks - 1:
                assert tuple(grads[d, g_slot]) == (c, m)
            sends.append((op, c, m))
        for d in range(s):
            op, c, m = sends[(d - 1) % s]
            if row[d, f["recv_act_slot"]] < t.num_act_slots:
                assert op == FORWARD and c + 1 < n_chunks
                acts[d, row[d, f["recv_act_slot"]]] = (c + 1, m)
            op, c, m = sends[(d + 1) % s]
            if row[d, f["recv_grad_slot"]] < t.num_grad_slots:
                assert op == BACKWARD and c > 0
                grads[d, row[d, f["recv_grad_slot"]]] = (c - 1, m)
    assert t.num_act_slots <= max(sim.peak_in_flight) + 1


def test_1f1b_with_fewer_microbatches_than_stages_is_refused():
    from openhosti_jax.errors import PipelineError

    with pytest.raises(PipelineError, match=r"M=2 < S=4; use M >= 4"):
        one_f_one_b(4, 2)
