"""Fault matrix: a tiny FSDP run checkpointed every 2 steps, with one fault injected per row; did training survive,
how many steps were lost, and was every failed save said (a warning or typed error naming the step and the path)?

Each row trains a state ``{"w": float32[2**20] sharded over 8 devices, "step"}`` for 12 steps with the `Trainer` and
a `TrainerCheckpoint` (``every_steps=2``, ``keep=None`` so every good step stays countable), against a reference
computed without checkpoints. The faults (this may run as root, where ``chmod`` stops no write; no loopback mount):

- ``read_only_at_start``: every write under the directory fails with EROFS (Python's file opens, mkdir, rename,
  unlink, patched) before the `TrainerCheckpoint` is made: a `CheckpointSaveError` must come before any step.
- ``read_only``: the same from step 5 to step 8 (the saves of steps 6 and 8 fail).
- ``full_disk``: ``RLIMIT_FSIZE`` of 64 KiB from step 5 to step 8: the kernel refuses TensorStore's chunk writes in
  the middle of a save (EFBIG), in Orbax's background threads.
- ``bucket_down`` / ``bucket_back``: the replica (an in-memory fsspec store) refuses every call from step 3 to step
  6, then answers again: training goes on, and the replica's newest step catches up (a fresh machine with an empty
  local directory restores step 12 from it).
- ``one_host_failing``: 2 processes (per-process directories), process 1's directory read-only for the save of step
  4: both count the failure, neither counts step 4 as good, both restore step 8 bit for bit.
- ``sigkill_mid_save``: a process training (0.1 s a step) and saving every 2 steps is SIGKILLed at a random moment
  after step 5; the newest good step restores, and only the save in flight may be lost.
- ``sigterm_full_disk``: the local disk full (ENOSPC on every write under it) from step 7, SIGTERM at step 8: the
  emergency checkpoint goes to the replica, and a fresh machine restores step 8 from it.

A row *survived* when the run ended as the policy says (all 12 steps at the reference state, or stopped by the
signal, or refused before training) and the newest good step restores bit for bit. ``steps_lost`` is the last step
trained minus the newest good step at the end; beyond one interval (2 steps; for the SIGKILL, any save before the
one in flight that is not good) it counts against the goal. A failed
save (a due step that never became good, locally or in the replica) that no warning or error named is *silent*.

Prints one JSON object on its last line (keys and goals in benchmarks/README.md); ``--quick`` runs every row too.
"""

import contextlib
import errno
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

N, STEPS, EVERY = 1 << 20, 12, 2


def reference(step: int):
    """The state after ``step`` updates ``w <- w / 2 + k`` from zeros (exact in float32), as a host array."""
    import numpy as np

    w = np.zeros(N, np.float32)
    for k in range(1, step + 1):
        w = w * np.float32(0.5) + np.float32(k)
    return w


@contextlib.contextmanager
def refused(directory, code):
    """Inside: writes under ``directory`` fail with ``OSError(code)`` (io.open/os.open for writing, mkdir, rename,
    replace, unlink, remove, rmdir)."""
    import builtins

    root = os.path.abspath(os.fspath(directory))

    def under(path):
        try:
            p = os.path.abspath(os.fspath(path))
        except TypeError:
            return False
        return p == root or p.startswith(root + os.sep)

    def no(path):
        return OSError(code, os.strerror(code), os.fspath(path))

    names = ("open", "mkdir", "rename", "replace", "unlink", "remove", "rmdir")
    real, real_open = {n: getattr(os, n) for n in names}, io.open

    def io_open(file, mode="r", *a, **k):
        if isinstance(mode, str) and any(c in mode for c in "wax+") and under(file):
            raise no(file)
        return real_open(file, mode, *a, **k)

    def os_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and under(path):
            raise no(path)
        return real["open"](path, flags, *a, **k)

    def one(name):
        return lambda path, *a, **k: (_ for _ in ()).throw(no(path)) if under(path) else real[name](path, *a, **k)

    def two(name):
        return lambda s, d, *a, **k: (_ for _ in ()).throw(no(d)) if under(s) or under(d) else real[name](s, d, *a, **k)

    patched = {"open": os_open, **{n: one(n) for n in ("mkdir", "unlink", "remove", "rmdir")}}
    patched |= {n: two(n) for n in ("rename", "replace")}
    try:
        io.open = builtins.open = io_open
        for n, f in patched.items():
            setattr(os, n, f)
        yield
    finally:
        io.open = builtins.open = real_open
        for n, f in real.items():
            setattr(os, n, f)


@contextlib.contextmanager
def file_size_limit(nbytes):
    """Inside: the kernel refuses writes past ``nbytes`` in any file of this process (EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def _flaky_store():
    """An in-memory fsspec store under ``flaky://`` that refuses every call while ``FlakyStore.down``."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class FlakyStore(MemoryFileSystem):
        protocol = ("flaky",)
        down = False

    def refusing(name):
        real = getattr(MemoryFileSystem, name)

        def call(self, *a, **k):
            if FlakyStore.down:
                raise ConnectionError(f"flaky store is down ({name})")
            return real(self, *a, **k)

        return call

    for name in ("put_file", "pipe_file", "cat_file", "ls", "exists", "find", "rm", "rm_file", "makedirs", "info"):
        setattr(FlakyStore, name, refusing(name))
    for name in ("get_file", "isdir"):
        setattr(FlakyStore, name, refusing(name))
    fsspec.register_implementation("flaky", FlakyStore, clobber=True)
    return FlakyStore


# -- one training run with hooks ---------------------------------------------------------------------------


def _train(directory, hooks, state=None, *, replicate_to=None):
    """Train STEPS steps with a checkpoint every EVERY; ``hooks[k]()`` runs before step k (``state["ckpt"]`` is the
    TrainerCheckpoint once made). Returns (result or None, the messages said, the error raised or None, the
    TrainerCheckpoint)."""
    state = {} if state is None else state
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from openhosti_jax.train import Trainer, TrainerCheckpoint

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    w0 = jax.device_put(jnp.zeros(N, jnp.float32), NamedSharding(mesh, PartitionSpec("fsdp")))
    update = jax.jit(lambda s, b: ({"w": s["w"] * 0.5 + b, "step": s["step"] + 1}, {"loss": jnp.mean(s["w"])}))
    calls = []

    def step(state, batch):
        calls.append(1)
        hook = hooks.get(len(calls))
        if hook is not None:
            hook()
        return update(state, batch)

    said, error, result, ckpt = [], None, None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ckpt = TrainerCheckpoint(
                directory,
                every_minutes=None,
                every_steps=EVERY,
                keep=None,
                replicate_to=replicate_to,
                max_failures=None,
            )
            state["ckpt"] = ckpt
            batches = [jnp.float32(k) for k in range(1, STEPS + 1)]
            result = Trainer(step, progress=False, log_every=1, checkpoint=ckpt).fit(
                {"w": w0, "step": jnp.int32(0)}, batches, num_steps=STEPS
            )
        except Exception as e:  # noqa: BLE001 - judged by the row
            error = e
    said = [str(w.message) for w in caught] + ([str(error)] + list(getattr(error, "__notes__", [])) if error else [])
    return result, said, error, ckpt


def _restores(directory, step, replicate_to=None) -> bool:
    """Whether ``step`` is the newest good step a fresh manager finds, and restores bit for bit."""
    import jax
    import numpy as np

    from openhosti_jax.checkpoint import CheckpointManager

    with CheckpointManager(directory, every_minutes=None, replicate_to=replicate_to) as ckpt:
        if ckpt.latest_good_step() != step:
            return False
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = {
            "w": jax.ShapeDtypeStruct((N,), np.float32, sharding=one),
            "step": jax.ShapeDtypeStruct((), np.int32, sharding=one),
        }
        restored, _, _ = ckpt.restore(abstract)
    return np.array_equal(np.asarray(restored["w"]), reference(step)) and int(restored["step"]) == step


def _row(survived, last, good, failed, said_texts, where, *, typed=None):
    """The row's verdict: ``failed`` due steps that never became good, each said by a message naming it and
    ``where`` (unless it names none: typed then says whether the error was typed and named the path)."""
    said = {s for s in failed if any(f"step {s} " in t and where in t for t in said_texts)}
    lost = None if good is None else last - good
    return {
        "survived": bool(survived),
        "steps_lost": lost,
        "steps_lost_beyond_interval": None if lost is None else max(0, lost - EVERY),
        "failed_saves": sorted(failed),
        "silent_save_failures": len(set(failed) - said),
        "typed_and_named": bool(typed if typed is not None else set(failed) <= said),
    }


def _quiet_wait(manager) -> None:
    """``manager.wait()``; the failure it raises for the newest save was already said (and is counted)."""
    from openhosti_jax.errors import CheckpointSaveError

    try:
        manager.wait()
    except CheckpointSaveError:
        pass


def _ok_final(result) -> bool:
    import numpy as np

    return result is not None and np.array_equal(np.asarray(result.state["w"]), reference(STEPS))


# -- the rows ------------------------------------------------------------------------------------------------


def row_read_only_at_start(tmp):
    from openhosti_jax.errors import CheckpointSaveError

    d = os.path.join(tmp, "ro-start")
    with refused(tmp, errno.EROFS):
        result, said, error, _ = _train(d, {})
    typed = isinstance(error, CheckpointSaveError) and error.path == d and "Read-only" in str(error)
    return _row(typed and result is None, 0, 0, [], said, d, typed=typed)


def row_read_only(tmp):
    return _windowed_run(tmp, "read-only", lambda d: refused(d, errno.EROFS))


def row_full_disk(tmp):
    return _windowed_run(tmp, "full-disk", lambda d: file_size_limit(64 << 10))


def _windowed_run(tmp, name, fault):
    """The fault from step 5 to step 8 (the saves of steps 6 and 8 meet it)."""
    d = os.path.join(tmp, name)
    state = {}

    def start():
        state["ckpt"].manager.wait()  # step 4's background write is whole before the fault begins
        state["cm"] = fault(d)
        state["cm"].__enter__()

    def stop():
        _quiet_wait(state["ckpt"].manager)  # the last write under the fault is over before it ends
        state["cm"].__exit__(None, None, None)

    hooks = {5: start, 9: stop}
    result, said, error, ckpt = _train(d, hooks, state)
    good = ckpt.manager.good_steps()
    failed = [s for s in range(EVERY, STEPS + 1, EVERY) if s not in good]
    ok = error is None and _ok_final(result) and _restores(d, STEPS) and failed == [6, 8]
    return _row(ok, STEPS, max(good, default=0), failed, said, d)


def row_bucket(tmp):
    """Bucket down from step 3 to step 6 (the copies of steps 4 and 6 fail), back from step 7."""
    store = _flaky_store()
    url = f"flaky://bucket-{os.getpid()}/run"
    d = os.path.join(tmp, "bucket")
    state = {}

    def down():
        state["ckpt"].manager.wait()
        store.down = True

    def settle():  # every copy is tried before the next save (none is skipped as superseded)
        state["ckpt"].manager.wait()

    def up():
        state["ckpt"].manager.wait()
        store.down = False

    hooks = {3: down, 5: settle, 7: up, 9: settle, 11: settle}
    result, said, error, ckpt = _train(d, hooks, state, replicate_to=url)
    local = ckpt.manager.good_steps()
    remote = ckpt.manager.replica_steps()
    failed_remote = [s for s in (4, 6) if s not in remote]
    ok_down = error is None and _ok_final(result) and local == list(range(EVERY, STEPS + 1, EVERY))
    down_row = _row(ok_down, STEPS, max(local, default=0), failed_remote, said, url)
    fresh = os.path.join(tmp, "bucket-fresh")
    back = _row(_restores(fresh, STEPS, replicate_to=url), STEPS, max(remote, default=0), [], said, url)
    back["typed_and_named"] = down_row["typed_and_named"]
    return down_row, back


def row_sigterm_full_disk(tmp):
    store = _flaky_store()
    url = f"flaky://bucket-sigterm-{os.getpid()}/run"
    d = os.path.join(tmp, "sigterm")
    state = {}

    def full():
        state["ckpt"].manager.wait()
        state["cm"] = refused(d, errno.ENOSPC)
        state["cm"].__enter__()

    hooks = {7: full, 8: lambda: os.kill(os.getpid(), signal.SIGTERM)}
    try:
        result, said, error, ckpt = _train(d, hooks, state, replicate_to=url)
    finally:
        if "cm" in state:
            state["cm"].__exit__(None, None, None)
    store.down = False
    stopped = error is None and result is not None and result.interrupted
    last = int(result.state["step"]) if result is not None else None
    remote = ckpt.manager.replica_steps()
    fresh = os.path.join(tmp, "sigterm-fresh")
    ok = stopped and last == 8 and 8 in remote and _restores(fresh, 8, replicate_to=url)
    failed = [s for s in (8,) if s not in ckpt.manager.good_steps()]
    return _row(ok, last or 0, max(remote, default=0), failed, said, d)


_KILL_CHILD = "--kill-child"
_HOST_CHILD = "--host-child"


def kill_child(directory):
    """Train (0.1 s a step) and save every EVERY steps (async) until killed; print each step once its save call
    returned."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from openhosti_jax.checkpoint import CheckpointManager

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    with CheckpointManager(directory, every_minutes=None, every_steps=EVERY, keep=None) as ckpt:
        w = jnp.zeros(N, jnp.float32)
        for step in range(1, 10_000):
            time.sleep(0.1)  # the step's compute
            w = w * 0.5 + step
            ckpt.maybe_save(step, {"w": jax.device_put(w, sharding), "step": jnp.int32(step)})
            print("STEP", step, flush=True)


def row_sigkill(tmp, seed=None):
    import random

    d = os.path.join(tmp, "sigkill")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, __file__, _KILL_CHILD, d],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    last = 0
    try:
        deadline = time.monotonic() + 120
        while last < 5 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            last = int(line.split()[1])
        time.sleep(random.Random(seed).uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
        last = max([last] + [int(x.split()[1]) for x in rest.splitlines() if x.startswith("STEP")])
    finally:
        proc.kill()
    from openhosti_jax.checkpoint import CheckpointManager

    with CheckpointManager(d, every_minutes=None) as ckpt:
        good = ckpt.latest_good_step()
    ok = good is not None and _restores(d, good)
    row = _row(ok, last, good, [], [], d, typed=True)
    # only the newest save started (in flight when the kill came) may be lost: every one before it is good
    newest_started = last - last % EVERY
    row["steps_lost_beyond_interval"] = None if good is None else max(0, newest_started - EVERY - good)
    return row


def host_child(base):
    """One of 2 processes: per-process directories; process 1's is read-only for the save of step 4."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.mesh import initialize_distributed

    initialize_distributed()
    me = jax.process_index()
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    directory = os.path.join(base, f"p{me}")
    said = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(directory, every_minutes=None, every_steps=2, keep=None, max_failures=None) as ckpt:
            for step in range(1, 9):
                w = reference(step)
                state = {"w": jax.make_array_from_callback((N,), sharding, lambda idx, w=w: w[idx])}
                _quiet_wait(ckpt)
                with refused(directory, errno.EROFS) if (me == 1 and step == 4) else contextlib.nullcontext():
                    ckpt.maybe_save(step, state)
                    _quiet_wait(ckpt)
            _quiet_wait(ckpt)
            good, failures = ckpt.good_steps(), ckpt.faults.count
        said = [str(w.message) for w in caught]
        with CheckpointManager(directory, every_minutes=None) as again:
            latest = again.latest_good_step()
            abstract = {"w": jax.ShapeDtypeStruct((N,), np.float32, sharding=sharding)}
            restored, _, _ = again.restore(abstract)
        exact = all(
            np.array_equal(np.asarray(s.data), reference(latest)[s.index]) for s in restored["w"].addressable_shards
        )
    out = {"process": me, "good": good, "failures": failures, "latest": latest, "exact": bool(exact), "said": said}
    print("RESULT", json.dumps(out), flush=True)


def row_one_host(tmp):
    from openhosti_jax.mesh.launch import launch_local

    base = os.path.join(tmp, "hosts")
    log = io.StringIO()
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, __file__, _HOST_CHILD, base]
    rc = launch_local(cmd, 2, local_devices=2, env=env, timeout_s=240, kill_grace_s=2, output=log)
    results = [json.loads(x.split("RESULT ", 1)[1]) for x in log.getvalue().splitlines() if "RESULT " in x]
    if rc != 0 or len(results) != 2:
        print(log.getvalue()[-3000:], file=sys.stderr)
        return _row(False, 8, None, [4], [], base)
    agreed = all(r["good"] == [2, 6, 8] and r["failures"] == 1 for r in results)
    ok = agreed and all(r["latest"] == 8 and r["exact"] for r in results)
    said = [t for r in results for t in r["said"]]
    return _row(ok, 8, min(max(r["good"]) for r in results), [4], said, base)


def main():
    import goals

    rows = {}
    with tempfile.TemporaryDirectory(prefix="openhosti-faults-") as tmp:
        rows["read_only_at_start"] = row_read_only_at_start(tmp)
        rows["read_only"] = row_read_only(tmp)
        rows["full_disk"] = row_full_disk(tmp)
        rows["bucket_down"], rows["bucket_back"] = row_bucket(tmp)
        rows["one_host_failing"] = row_one_host(tmp)
        rows["sigkill_mid_save"] = row_sigkill(tmp)
        rows["sigterm_full_disk"] = row_sigterm_full_disk(tmp)
    for name, r in rows.items():
        print(
            f"{name:<20} survived={r['survived']!s:<5} steps_lost={r['steps_lost']} failed_saves={r['failed_saves']} "
            f"silent={r['silent_save_failures']} typed_and_named={r['typed_and_named']}",
            file=sys.stderr,
        )
    ok = [r["survived"] and r["steps_lost_beyond_interval"] == 0 and r["typed_and_named"] for r in rows.values()]
    out = {
        "faults": rows,
        "faults_injected": len(rows),
        "faults_survived_over_injected": sum(ok) / len(rows),
        "silent_save_failures": sum(r["silent_save_failures"] for r in rows.values()),
        "steps_lost_beyond_interval": max(r["steps_lost_beyond_interval"] or 0 for r in rows.values()),
    }
    goals.emit(out, __file__)


if __name__ == "__main__":
    if _KILL_CHILD in sys.argv:
        kill_child(sys.argv[sys.argv.index(_KILL_CHILD) + 1])
    elif _HOST_CHILD in sys.argv:
        host_child(sys.argv[sys.argv.index(_HOST_CHILD) + 1])
    else:
        main()
