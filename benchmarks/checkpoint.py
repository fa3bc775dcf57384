"""Checkpoint benchmark: caller-blocking time of an async save vs a synchronous save, the cost of checksums
on save and on restore, and the training-step slowdown while a save runs in the background.

State: 1 GiB of random float32 (8 arrays of 8192 x 4096), FSDP-sharded over 8 simulated CPU devices.
  sync   : `CheckpointManager(async_save=False).maybe_save` -- returns once Orbax has committed the step;
           the `wait()` after it is the checksumming of the committed files (hurried, all threads)
  async  : `CheckpointManager().maybe_save` -- returns once Orbax has copied the arrays off the devices
  restore: `restore(verify=True)` (checksums of the files read, then the read) vs `restore(verify=False)`
Sync and async saves alternate, ``REPS`` each, then verified and plain restores alternate, ``REPS`` each;
medians. Then a small jitted training step (matmuls over a sharded batch) is timed alone and while an async
save of the 1 GiB state runs in the background (steps taken between the save call's return and the step
counting as good: write, commit and paced checksums), ``BASE_STEPS`` alone around each of ``BG_ROUNDS``
saves (half before, half after, so that a change in the machine's other load hits both); medians of per-step
times.

Replication (the second tier, a local path as the replica: loopback): the same step loop saves the state every
few steps, each save once the previous one is good locally, alternately with and without ``replicate_to``; the
time the loop waits on replication is the median `maybe_save` call with a replica minus the median without, over
the median step (the copies run on their own thread; a difference of medians, so noise can make it slightly
negative). Restore from the replica (a fresh, empty local directory:
the newest replica step is fetched, then restored and verified) is timed against a restore from the intact local
directory, alternating, ``REPS`` each.

On this machine the 8 "devices" and the background writer share 2 CPU cores (and other users' load), so the
background write takes compute from the step; on accelerators the write runs on host cores the step does not use.

Prints one JSON object on its last line (keys and goals in benchmarks/README.md). ``--quick``: a 128 MiB state
(8 arrays of 2048 x 2048), 3 reps, 1 background round of 20 steps around it; the same code paths.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import goals  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

from openhosti_jax.checkpoint import CheckpointManager  # noqa: E402

REPS = 3 if goals.QUICK else 5
# background-save rounds; each times every step during one save and BASE_STEPS steps around it
BG_ROUNDS, BASE_STEPS = (1, 20) if goals.QUICK else (3, 40)
ARRAYS, ROWS, COLS = (8, 2048, 2048) if goals.QUICK else (8, 8192, 4096)  # full: 8 x 128 MiB = 1 GiB
SAVES_PER_ROUND = 3  # replication rounds: saves in one run of the step loop


def make_state(mesh):
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    keys = jax.random.split(jax.random.key(0), ARRAYS)
    init = jax.jit(lambda k: jax.random.normal(k, (ROWS, COLS), jnp.float32), out_shardings=sharding)
    return {f"layer{i}": init(keys[i]) for i in range(ARRAYS)}


def make_step(mesh):
    w_sharding = NamedSharding(mesh, PartitionSpec(None, "fsdp"))
    x_sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    w = jax.device_put(jax.random.normal(jax.random.key(1), (512, 512)) / 24.0, w_sharding)
    x = jax.device_put(jax.random.normal(jax.random.key(2), (1024, 512)), x_sharding)

    @jax.jit
    def step(w, x):
        def loss(w):
            h = x
            for _ in range(4):
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        return w - 0.01 * jax.grad(loss)(w)

    jax.block_until_ready(step(w, x))
    return step, w, x


def timed_save(directory, state, step, async_save):
    with CheckpointManager(directory, every_minutes=None, keep=1, async_save=async_save) as ckpt:
        t0 = time.perf_counter()
        ckpt.maybe_save(step, state, force=True)
        blocking = time.perf_counter() - t0
        ckpt.wait()
        total = time.perf_counter() - t0
    return blocking, total


def timed_restores(directory, state, reps):
    """(verified, plain) restore times of the step in ``directory``, alternating, ``reps`` each."""
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
    verified, plain = [], []
    with CheckpointManager(directory, every_minutes=None, keep=1) as ckpt:
        jax.block_until_ready(ckpt.restore(abstract, verify=False)[0])  # warm-up
        for _ in range(reps):
            for verify, out in ((True, verified), (False, plain)):
                t0 = time.perf_counter()
                restored, _, _ = ckpt.restore(abstract, verify=verify)
                jax.block_until_ready(restored)
                out.append(time.perf_counter() - t0)
                del restored
    return verified, plain


def steps_while(fn, w, x, until):
    """Per-step times of ``fn`` while ``until()`` is False (at least 3 steps)."""
    times = []
    while len(times) < 3 or not until():
        t0 = time.perf_counter()
        w = jax.block_until_ready(fn(w, x))
        times.append(time.perf_counter() - t0)
    return times


def steps_n(fn, w, x, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        w = jax.block_until_ready(fn(w, x))
        times.append(time.perf_counter() - t0)
    return times


def replication_figures(step, w, x, state, root):
    """(maybe_save seconds with a replica, without; step seconds; restore seconds from replica, from local)."""
    calls = {True: [], False: []}
    steps = []
    replica = os.path.join(root, "replica")
    for r in range(REPS):
        for replicated in (False, True):
            d = os.path.join(root, f"rep{r}{int(replicated)}")
            target = replica if replicated else None
            with CheckpointManager(d, every_minutes=None, keep=2, replicate_to=target) as ckpt:
                for save in range(1, SAVES_PER_ROUND + 1):
                    t0 = time.perf_counter()
                    ckpt.maybe_save(save, state, force=True)
                    calls[replicated].append(time.perf_counter() - t0)
                    # train until this save is good locally; its copy to the replica goes on meanwhile
                    steps += steps_while(step, w, x, lambda ckpt=ckpt, save=save: save in ckpt.good_steps())
            if replicated and r < REPS - 1:
                shutil.rmtree(d)
    local = os.path.join(root, f"rep{REPS - 1}1")
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
    from_replica, from_local = [], []
    for r in range(REPS):
        for fetched in (False, True):
            d = os.path.join(root, f"fetch{r}") if fetched else local
            t0 = time.perf_counter()
            with CheckpointManager(d, every_minutes=None, replicate_to=replica if fetched else None) as ckpt:
                restored, _, _ = ckpt.restore(abstract)
                jax.block_until_ready(restored)
                assert ckpt.restored_step == SAVES_PER_ROUND and (ckpt.fetched_step is not None) == fetched
            (from_replica if fetched else from_local).append(time.perf_counter() - t0)
            del restored
            if fetched:
                shutil.rmtree(d)
    return calls[True], calls[False], steps, from_replica, from_local


def main():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    state = jax.block_until_ready(make_state(mesh))
    gib = sum(x.nbytes for x in state.values()) / 2**30
    root = tempfile.mkdtemp(prefix="openhosti_ckpt_bench_")
    try:
        timed_save(os.path.join(root, "warm"), state, 0, True)  # compile / import warm-up
        sync_block, async_block, sync_total, async_total = [], [], [], []
        for r in range(REPS):
            for mode in ("sync", "async"):
                d = os.path.join(root, f"{mode}{r}")
                blocking, total = timed_save(d, state, r + 1, mode == "async")
                (async_block if mode == "async" else sync_block).append(blocking)
                (async_total if mode == "async" else sync_total).append(total)
                if mode == "sync" and r == REPS - 1:
                    verified, plain = timed_restores(d, state, REPS)
                shutil.rmtree(d)
        step, w, x = make_step(mesh)
        base, during = [], []
        for r in range(BG_ROUNDS):
            d = os.path.join(root, f"bg{r}")
            base += steps_n(step, w, x, BASE_STEPS // 2)  # no save running, just before and just after
            with CheckpointManager(d, every_minutes=None, keep=1) as ckpt:
                ckpt.maybe_save(r + 1, state, force=True)
                done = []

                def finished(ckpt=ckpt, done=done):
                    # the background commit + checksum has finished once the step is good
                    if not done and ckpt.good_steps():
                        done.append(True)
                    return bool(done)

                during += steps_while(step, w, x, finished)
            shutil.rmtree(d)
            base += steps_n(step, w, x, BASE_STEPS // 2)
        with_replica, without_replica, rep_steps, from_replica, from_local = replication_figures(
            step, w, x, state, os.path.join(root, "replication")
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    checksum = [total - blocking for total, blocking in zip(sync_total, sync_block, strict=True)]
    out = {
        "state_gib": round(gib, 3),
        "async_blocking_over_sync_save": med(async_block) / med(sync_block),
        "step_slowdown_during_save": med(during) / med(base) - 1.0,
        "checksum_seconds_over_save_seconds": med(checksum) / med(sync_block),
        "restore_verify_over_restore": med(verified) / med(plain),
        "replication_blocking_over_step": (med(with_replica) - med(without_replica)) / med(rep_steps),
        "restore_from_replica_over_local": med(from_replica) / med(from_local),
        "async_blocking_s": med(async_block),
        "sync_save_s": med(sync_block),
        "sync_save_with_checksums_s": med(sync_total),
        "checksum_s": med(checksum),
        "restore_verified_s": med(verified),
        "restore_plain_s": med(plain),
        "async_save_total_s": med(async_total),
        "step_s_without_save": med(base),
        "step_s_during_save": med(during),
        "steps_timed_during_save": len(during),
        "save_call_s_with_replica": med(with_replica),
        "save_call_s_without_replica": med(without_replica),
        "step_s_replication_rounds": med(rep_steps),
        "restore_from_replica_s": med(from_replica),
        "restore_from_local_s": med(from_local),
        "reps": REPS,
        "background_rounds": BG_ROUNDS,
    }
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
