"""30 steps straight == 15 steps, SIGKILL, restart by the supervisor, resume, 15 more: same losses, same bits.

This file is also the training program: ``python tests/test_checkpoint_resume.py DIR LOG STEPS [CRASH_AT]``
trains a small flax MLP with dropout (rng in the state) on a shuffling `ArrayDataset`, FSDP-sharded over 8 CPU
devices, checkpointing every 15 steps and at the end; with ``CRASH_AT`` its first attempt SIGKILLs itself
after that step.
"""

import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 16


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),
    }


def build():
    """(state placed FSDP on 8 devices, jitted train step, dataset) -- the same in every process."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from openhosti_jax.data import ArrayDataset
    from openhosti_jax.state import TrainState

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.Dropout(0.3, deterministic=not train)(x)
            return nn.Dense(1)(x)[:, 0]

    model = MLP()
    rs = np.random.default_rng(0)
    x = rs.normal(size=(64, 8)).astype(np.float32)
    y = (x @ rs.normal(size=8) + 0.1 * rs.normal(size=64)).astype(np.float32)
    data = ArrayDataset({"x": x, "y": y}, GLOBAL_BATCH, seed=7)
    params = model.init(jax.random.key(0), jnp.ones((1, 8)), train=False)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2), rng=jax.random.key(1))
    state = state.replace(step=jnp.int32(0))
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

    def place(leaf):
        shape = getattr(leaf, "shape", ())
        spec = PartitionSpec("fsdp") if len(shape) and shape[0] % 8 == 0 else PartitionSpec()
        return NamedSharding(mesh, spec)

    state = jax.device_put(state, jax.tree.map(place, state))
    batch_sharding = NamedSharding(mesh, PartitionSpec("fsdp"))

    @jax.jit
    def train_step(state, batch):
        state, key = state.next_rng()

        def loss_fn(p):
            pred = state.apply_fn({"params": p}, batch["x"], train=True, rngs={"dropout": key})
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def step(state, batch):
        return train_step(state, jax.device_put(batch, batch_sharding))

    return state, step, data


def _main(directory: str, log: str, steps: int, crash_at: int | None) -> None:
    from openhosti_jax.checkpoint import RESTART_ENV, CheckpointManager
    from openhosti_jax.state import abstract_train_state

    state, step, data = build()
    attempt = int(os.environ.get(RESTART_ENV, "0"))
    with CheckpointManager(directory, every_minutes=None, every_steps=15, keep=3) as ckpt:
        start = ckpt.latest_good_step()
        if start is not None:
            state, data_state, meta = ckpt.restore(abstract_train_state(state))
            data.set_state(data_state)
            assert meta == {"attempt_started": meta["attempt_started"]} and int(state.step) == start
        with open(log, "a") as f:
            for i in range((start or 0) + 1, steps + 1):
                state, loss = step(state, next(data))
                f.write(f"{attempt} {i} {np.float32(loss).tobytes().hex()}\n")
                f.flush()
                ckpt.maybe_save(i, state, data_state=data.get_state(), meta={"attempt_started": attempt})
                if crash_at is not None and attempt == 0 and i == crash_at:
                    ckpt.wait()  # the step-15 save must be committed before the crash
                    os.kill(os.getpid(), signal.SIGKILL)
        ckpt.maybe_save(steps, state, data_state=data.get_state(), meta={"attempt_started": attempt}, force=True)


def _losses(log: pathlib.Path) -> tuple[dict[int, str], list[tuple[int, int, str]]]:
    rows = [(int(a), int(s), h) for a, s, h in (line.split() for line in log.read_text().splitlines())]
    last = {}
    for _, s, h in rows:
        last[s] = h
    return last, rows


@pytest.mark.slow  # 33 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
def test_kill_and_resume_matches_straight_run(tmp_path):
    import jax

    from openhosti_jax.checkpoint import CheckpointManager, run_with_restarts
    from openhosti_jax.state import abstract_train_state

    me = str(pathlib.Path(__file__).resolve())
    straight = subprocess.Popen(  # runs side by side with the supervised one
        [sys.executable, me, str(tmp_path / "a"), str(tmp_path / "a.log"), "30"],
        env=_env(),
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rc = run_with_restarts(
            [sys.executable, me, str(tmp_path / "b"), str(tmp_path / "b.log"), "30", "17"],
            max_restarts=2,
            backoff_s=0.1,
            env=_env(),
        )
        _, err = straight.communicate(timeout=240)
    finally:
        straight.kill()
    assert straight.returncode == 0, err[-3000:]
    assert rc == 0
    want, _ = _losses(tmp_path / "a.log")
    got, rows = _losses(tmp_path / "b.log")
    # attempt 0 ran steps 1-17 and was killed; attempt 1 resumed from the step-15 checkpoint
    assert [(a, s) for a, s, _ in rows] == [(0, s) for s in range(1, 18)] + [(1, s) for s in range(16, 31)]
    assert sorted(want) == sorted(got) == list(range(1, 31))
    assert [got[s] for s in range(1, 31)] == [want[s] for s in range(1, 31)]  # bit-identical float32 losses
    redone = {s: h for a, s, h in rows if a == 0 and s > 15}
    assert all(got[s] == h for s, h in redone.items())

    template, _, _ = build()
    abstract = abstract_train_state(template)
    finals = []
    for name in "ab":
        with CheckpointManager(tmp_path / name, every_minutes=None) as ckpt:
            assert ckpt.latest_good_step() == 30
            finals.append(ckpt.restore(abstract))
    (sa, da, _), (sb, db, _) = finals
    assert da == db and da["epoch"] == 30 * GLOBAL_BATCH // 64
    assert int(sa.step) == int(sb.step) == 30
    leaves_a, leaves_b = jax.tree.leaves(sa), jax.tree.leaves(sb)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # params, adam moments, count, rng
    # and the restored params differ from the initial ones (training happened)
    assert not np.array_equal(
        np.asarray(sa.params["Dense_0"]["kernel"]), np.asarray(template.params["Dense_0"]["kernel"])
    )


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
