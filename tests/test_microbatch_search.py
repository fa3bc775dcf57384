"""The finder picks the largest microbatch whose compiled peak fits; checked against exhaustive search."""

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import MemoryBudgetError, PlanningError
from openhosti_jax.mesh import MeshConfig, budget_from_devices, build_mesh
from openhosti_jax.microbatch import (
    analytic_peak_bytes,
    compile_bound,
    compiled_peak_bytes,
    find_microbatch,
    make_train_step,
    peak_bytes,
)
from openhosti_jax.sizes import divisors
from openhosti_jax.state import TrainState

PER_DEVICE = 128
W, LAYERS = 32, 4


def _loss(p, mb, rng):
    h = mb["x"]
    for i in range(LAYERS):
        h = jnp.tanh(h @ p[f"w{i}"])
    m = mb["mask"].astype(jnp.float32)
    return jnp.sum(((h @ p["out"])[:, 0] - mb["y"]) ** 2 * m), jnp.sum(m)


@pytest.fixture(scope="module")
def compiled_for():
    """size -> compiled MLP + Adam step with that per-device microbatch (memoised: one compile per size)."""
    mesh = build_mesh(MeshConfig(data=8))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    keys = jax.random.split(jax.random.key(0), LAYERS + 1)
    params = {f"w{i}": jax.random.normal(keys[i], (W, W)) / 6 for i in range(LAYERS)}
    params["out"] = jax.random.normal(keys[-1], (W, 1))
    state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3), rng=jax.random.key(1))
    state = jax.device_put(state, rep)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
    n = 8 * PER_DEVICE
    batch = {
        "x": jax.ShapeDtypeStruct((n, W), jnp.float32, sharding=rows),
        "y": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=rows),
        "mask": jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=rows),
    }
    cache = {}

    def compile_for(size):
        if size not in cache:
            step = make_train_step(_loss, PER_DEVICE // size, microbatch_sharding=rows)
            cache[size] = jax.jit(step, donate_argnums=0).lower(abstract, batch).compile()
        return cache[size]

    return compile_for


@pytest.mark.slow  # 8 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_chosen_fits_and_double_does_not(compiled_for):
    peaks = {s: compiled_peak_bytes(compiled_for(s)) for s in divisors(PER_DEVICE)}
    sizes = sorted(peaks)
    # the search assumes peaks grow with the size below the full batch (k=1 is compiled first, on its own)
    assert all(peaks[a] <= peaks[b] for a, b in zip(sizes[:-1], sizes[1:-1], strict=False)), peaks
    growing = [s for s in sizes if 2 * s in peaks and peaks[2 * s] > peaks[s]]
    assert growing, f"test model's peak does not grow with the microbatch: {peaks}"
    for target in (growing[0], growing[-1]):
        budget = peaks[target]  # synthetic budget: exactly what `target` needs
        calls = []
        choice = find_microbatch(
            lambda s, calls=calls: calls.append(s) or compiled_for(s), PER_DEVICE, budget, margin=0.0
        )
        largest_fitting = max(s for s in sizes if peaks[s] <= budget)
        assert choice.size == largest_fitting
        assert choice.peak_bytes == peaks[choice.size] <= budget
        assert peaks[2 * choice.size] > budget  # double does not fit
        assert choice.num_microbatches == PER_DEVICE // choice.size
        assert choice.compiles == len(calls) <= compile_bound(PER_DEVICE)
        assert choice.compiled is compiled_for(choice.size)
        assert f"microbatch {choice.size} x {choice.num_microbatches}" in str(choice)


def test_margin_is_respected(compiled_for):
    top = compiled_peak_bytes(compiled_for(PER_DEVICE))
    choice = find_microbatch(compiled_for, PER_DEVICE, budget_bytes=top, margin=0.0)
    assert choice.size == PER_DEVICE and choice.compiles == 1
    smaller = find_microbatch(compiled_for, PER_DEVICE, budget_bytes=top, margin=0.1)
    assert smaller.peak_bytes <= 0.9 * top and smaller.size < PER_DEVICE


def test_analytic_fallback_when_backend_reports_zeros(compiled_for):
    real = compiled_for(PER_DEVICE)
    zeros = SimpleNamespace(
        peak_memory_in_bytes=0,
        argument_size_in_bytes=0,
        output_size_in_bytes=0,
        temp_size_in_bytes=0,
        alias_size_in_bytes=0,
    )
    blank = SimpleNamespace(
        memory_analysis=lambda: zeros,
        cost_analysis=real.cost_analysis,
        args_info=real.args_info,
        input_shardings=real.input_shardings,
        out_info=real.out_info,
    )
    assert compiled_peak_bytes(blank) is None
    estimate = peak_bytes(blank)
    assert estimate == analytic_peak_bytes(real)
    assert estimate >= compiled_peak_bytes(real)  # conservative: never below what XLA allocates
    assert peak_bytes(blank, fallback=lambda c: 123) == 123


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 512), per_sample=st.integers(1, 50), fixed=st.integers(0, 1000), frac=st.floats(0, 1.2))
def test_binary_search_equals_exhaustive_on_monotone_peaks(batch, per_sample, fixed, frac):
    def peak(size):
        return fixed + per_sample * size + (size * size) // 7

    budget = int(frac * peak(batch)) + 1
    calls = []
    fits = [s for s in divisors(batch) if peak(s) <= budget]
    if not fits:
        with pytest.raises(MemoryBudgetError, match="needs"):
            find_microbatch(lambda s: s, batch, budget, margin=0.0, peak_fn=peak)
        return
    choice = find_microbatch(lambda s: calls.append(s) or s, batch, budget, margin=0.0, peak_fn=peak)
    assert choice.size == max(fits)
    assert len(calls) == choice.compiles <= math.ceil(math.log2(batch)) + 2


def test_explicit_sizes_and_bad_input():
    choice = find_microbatch(lambda s: s, 10, 70, margin=0.0, sizes=[3, 7, 9], peak_fn=lambda s: 10 * s)
    assert (choice.size, choice.num_microbatches) == (7, 2)
    with pytest.raises(PlanningError, match="1..10"):
        find_microbatch(lambda s: s, 10, 70, sizes=[0, 11], peak_fn=lambda s: s)
    with pytest.raises(PlanningError, match="margin"):
        find_microbatch(lambda s: s, 10, 70, margin=1.5, peak_fn=lambda s: s)
    with pytest.raises(PlanningError, match="peak_fn"):
        find_microbatch(lambda s: s, 10, 70, peak_fn=lambda s: None)


def test_budget_from_devices():
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    cpu_budget = budget_from_devices()  # CPU: no memory stats, host RAM shared by the 8 local devices
    assert abs(cpu_budget - total_kib * 1024 // 8) <= 0.01 * cpu_budget
    fake = [SimpleNamespace(memory_stats=lambda v=v: {"bytes_limit": v}) for v in (5 << 30, 3 << 30)]
    assert budget_from_devices(fake) == 3 << 30


_AGREE = textwrap.dedent(
    """
    import json, sys
    import jax
    from openhosti_jax.mesh import initialize_distributed
    from openhosti_jax.mesh.barrier import gathered
    from openhosti_jax.microbatch import find_microbatch
    pid = int(sys.argv[2])
    initialize_distributed(sys.argv[1], 2, pid, timeout_s=60)
    budget = 700 if pid == 0 else 350  # the processes disagree locally
    choice = find_microbatch(lambda s: s, 12, budget, margin=0.0, peak_fn=lambda s: 100 * s)
    big = gathered("big", (pid + 5, 2**40 + pid))[0]  # process 0's, ints past int32 intact
    print(json.dumps({"size": choice.size, "peak": choice.peak_bytes, "big": big}))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_processes_agree_on_process_zero_choice(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "agree.py"
    script.write_text(_AGREE)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), f"127.0.0.1:{port}", str(pid)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert outs[0] == outs[1] == {"size": 6, "peak": 600, "big": [5, 2**40]}
