"""SIGKILL a process at random moments while it saves: the latest good step always restores and verifies.

This file is also the saving program: ``python tests/test_checkpoint_faults.py DIR`` saves step after step
(async, ~32 MiB each) of a state whose every value is a known function of the step, until it is killed.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
N = 1 << 20


def expected(step: int) -> dict:
    """The state saved as ``step``: 8 float32 arrays of 1M values, each an exact function of the step."""
    base = np.arange(N, dtype=np.float32)
    return {f"a{i}": base * np.float32(i + 1) + np.float32(step) for i in range(8)} | {"step": np.int32(step)}


def _main(directory: str) -> None:
    import jax

    from openhosti_jax.checkpoint import CheckpointManager

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    with CheckpointManager(directory, every_minutes=None, keep=3) as ckpt:
        for step in range(1, 10_000):
            state = {k: jax.device_put(v, sharding) if v.ndim else v for k, v in expected(step).items()}
            ckpt.maybe_save(step, state, data_state={"position": step}, force=True)
            if step == 1:
                ckpt.wait()
                print("READY", flush=True)


def _spawn(directory: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen(
        [sys.executable, __file__, str(directory)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _check(directory: pathlib.Path) -> tuple[int, bool]:
    """(latest good step, whether a partial save was left behind); asserts it restores and verifies."""
    import jax

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.checkpoint.checksums import has_checksums

    names = [p.name for p in directory.iterdir()]
    partial = any(not n.isdigit() for n in names) or any(not has_checksums(directory / n) for n in names if n.isdigit())
    with CheckpointManager(directory, every_minutes=None) as ckpt:
        good = ckpt.good_steps()
        assert good and all(str(s) in names for s in good)  # never a temporary folder
        for s in good:
            assert ckpt.verify(s) == [], s
        latest = good[-1]
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device) for k, v in expected(latest).items()}
        state, data_state, _ = ckpt.restore(abstract)
    assert data_state == {"position": latest}
    for k, v in expected(latest).items():
        np.testing.assert_array_equal(np.asarray(state[k]), v)
    return latest, partial


def _run(tmp_path, trials: int, seed: int, parallel: int) -> None:
    """Kill ``trials`` saving processes (``parallel`` at a time) each at a random moment, then check each."""
    rs = np.random.default_rng(seed)
    results = []
    for first in range(0, trials, parallel):
        dirs = [tmp_path / str(t) for t in range(first, min(trials, first + parallel))]
        procs = [_spawn(d) for d in dirs]
        try:
            kill_at = []
            for p in procs:
                assert p.stdout.readline().strip() == "READY"
                kill_at.append(time.monotonic() + rs.uniform(0.0, 2.0))  # saves are in flight all along
            for t, p in sorted(zip(kill_at, procs, strict=True), key=lambda x: x[0]):
                time.sleep(max(0.0, t - time.monotonic()))
                p.send_signal(signal.SIGKILL)
            for p in procs:
                p.wait(timeout=30)
        finally:
            for p in procs:
                p.kill()
        results += [_check(d) for d in dirs]
    assert all(latest >= 1 for latest, _ in results)
    assert any(partial for _, partial in results)  # at least one kill really landed inside a save


@pytest.mark.slow  # 19 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(240)
def test_sigkill_during_saves_fast(tmp_path):
    _run(tmp_path, trials=5, seed=0, parallel=5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_during_saves_slow(tmp_path):
    _run(tmp_path, trials=20, seed=1, parallel=4)


if __name__ == "__main__":
    _main(sys.argv[1])
