"""Soak: `openhosti run` keeps a GPT job going through 10 SIGKILLs at random moments, some during async saves.

The job (this file run as ``python tests/test_soak.py DIR LOG STEPS FINAL``) trains a tiny GPT with the `Trainer`
and `TrainerCheckpoint` (async saves every 3 steps, resume from the latest good one), 2 CPU devices, FSDP. For every
step it applies it appends ``STEP attempt step sample-ids loss-bits`` to LOG (the sample ids are the corpus rows
of the batch it was given, so the data stream is audited, not the iterator's own account of it), and at the end
it writes every leaf of the final state (params, Adam moments, count, rng) to FINAL.

The harness kills the job 10 times at seeded random moments: once the attempt has saved a step past the one it
resumed from (so that the run progresses), either after a random delay or at the first moment a save is seen in
flight; or at a random moment of its start-up (import, compile, restore). A kill
counts as "during a save" when, just before it, an Orbax temporary folder or a committed step without its
checksum records (`has_checksums`) was on disk. Afterwards: the final state is bitwise the one of an uninterrupted
run; every attempt resumed at a checkpoint at or before the last step the previous one applied (no step lost);
each step redone after a rollback saw the same samples and gave the same loss bits as before; and the steps that
count (the last time each was applied) are exactly the uninterrupted run's steps, samples and losses, in order.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from openhosti_jax.checkpoint.checksums import has_checksums

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS, KILLS, EVERY = 100, 10, 3
STEP_SLEEP_S = 0.05


def _job(directory: str, log: str, steps: int, final: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from openhosti_jax.checkpoint import RESTART_ENV
    from openhosti_jax.demo.gpt_job import GPTJob, build_job
    from openhosti_jax.models.gpt import GPTConfig, make_corpus
    from openhosti_jax.train import Trainer, TrainerCheckpoint

    attempt = os.environ.get(RESTART_ENV, "-")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def say(line: str) -> None:
        os.write(fd, (line + "\n").encode())  # one write per line: a kill never leaves half a line

    say(f"START {attempt} {os.getpid()}")
    model = GPTConfig.tiny(seq_len=16, d_model=32, n_heads=2, n_layers=1)
    job = GPTJob(model=model, steps=steps, global_batch=8, num_sequences=48, progress=False, print_plan=False)
    state, _, step, data = build_job(job)
    corpus = make_corpus(job.num_sequences, model.seq_len, seed=job.seed)  # what build_job feeds the dataset
    rows = {bytes(r.tobytes()): i for i, r in enumerate(np.asarray(corpus))}
    assert len(rows) == 48, "corpus rows must be distinct to name the samples"

    class Logged:
        """The SPMD step, logging what each application saw and gave."""

        def __getattr__(self, name: str):
            return getattr(step, name)

        def __call__(self, state, batch):
            n = int(state.step) + 1
            new, metrics = step(state, batch)
            ids = ",".join(str(rows[bytes(np.asarray(r).tobytes())]) for r in np.asarray(batch["tokens"]))
            loss = np.float32(metrics["loss"]).tobytes().hex()
            say(f"STEP {attempt} {n} {ids} {loss}")
            time.sleep(STEP_SLEEP_S)  # paces the run so that kills land all over it
            return new, metrics

    checkpoint = TrainerCheckpoint(directory, every_minutes=None, every_steps=EVERY, keep=3)
    result = Trainer(Logged(), progress=False, checkpoint=checkpoint).fit(state, data, num_steps=steps)
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(result.state)[0]:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        leaves[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(leaf))
    np.savez(final, **leaves)
    say(f"DONE {attempt} {int(result.state.step)}")


def _env(cache: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENHOSTI_")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    # every attempt (and the reference) loads the compiled programs from one cache, as a cluster job would
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update(JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _job_cmd(tmp: pathlib.Path, name: str) -> list[str]:
    return [sys.executable, __file__, str(tmp / name), str(tmp / f"{name}.log"), str(STEPS), str(tmp / f"{name}.npz")]


def _in_flight(directory: pathlib.Path) -> set[tuple[str, int]]:
    """(name, mtime) of each Orbax temporary folder and each committed step without its checksum record yet."""
    found = set()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return found
    for n in names:
        try:
            if not n.isdigit() or not has_checksums(directory / n):
                found.add((n, (directory / n).stat().st_mtime_ns))
        except FileNotFoundError:  # renamed or deleted meanwhile
            pass
    return found


def _read(log: pathlib.Path) -> tuple[list[tuple[str, int]], list[tuple[str, int, str, str]]]:
    starts, steps = [], []
    for line in log.read_text().splitlines():
        kind, attempt, *rest = line.split()
        if kind == "START":
            starts.append((attempt, int(rest[0])))
        elif kind == "STEP":
            steps.append((attempt, int(rest[0]), rest[1], rest[2]))
    return starts, steps


def _good(directory: pathlib.Path) -> int:
    """The newest committed and checksummed step (0: none)."""
    good = 0
    for n in os.listdir(directory) if directory.exists() else []:
        try:
            if n.isdigit() and int(n) > good and has_checksums(directory / n):
                good = int(n)
        except FileNotFoundError:  # rotated away meanwhile
            pass
    return good


def _last_step(log: pathlib.Path, attempt: str) -> int:
    return max((s for a, s, *_ in _read(log)[1] if a == attempt), default=0)


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_supervised_gpt_job_survives_ten_sigkills_bitwise(tmp_path):
    rng = np.random.default_rng(29)
    ckpt, log = tmp_path / "soak", tmp_path / "soak.log"
    err_path = tmp_path / "supervisor.err"  # a file, not a pipe: nobody reads a pipe while the job runs
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "openhosti_jax.cli", "run", "--max-restarts", str(KILLS + 2), "--backoff-s", "0"]
        + ["--", *_job_cmd(tmp_path, "soak")],
        env=_env(tmp_path / "jax-cache"),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(err_path, "w"),  # noqa: SIM115 - the child owns it
    )
    t0 = time.monotonic()
    kills = []  # (attempt, mode, during a save, last step logged before the kill)
    modes = rng.permutation(["save"] * 4 + ["random"] * 4 + ["startup"] * 2)
    try:
        for k in range(KILLS):
            attempt = str(k)
            _wait(lambda a=attempt: log.exists() and a in dict(_read(log)[0]), 120, f"attempt {k} to start")
            pid = dict(_read(log)[0])[attempt]
            mode = modes[k]
            if mode == "startup":  # while importing, compiling or restoring
                time.sleep(rng.uniform(1.0, 6.0))
                stale: set[tuple[str, int]] = set()
            else:
                _wait(lambda a=attempt: a in {x for x, *_ in _read(log)[1]}, 120, f"attempt {k} to step")
                resumed = min(s for a, s, *_ in _read(log)[1] if a == attempt) - 1
                stale = _in_flight(ckpt)  # left by the previous kill, not this attempt's saves
                # progress first: a step later than the resumed one is saved (committed and checksummed)
                _wait(lambda r=resumed: _good(ckpt) > r, 120, f"attempt {k} to save a step after {resumed}")
                if mode == "save":
                    _wait(lambda old=stale: _in_flight(ckpt) - old, 60, "a save in flight")
                else:
                    time.sleep(rng.uniform(0.0, 0.5))
            during = bool(_in_flight(ckpt) - stale)
            os.kill(pid, signal.SIGKILL)
            last = _last_step(log, attempt)
            assert last < STEPS, f"attempt {k} finished before kill {k + 1}: raise STEPS"
            kills.append((attempt, str(mode), during, last))
        ref_cmd = _job_cmd(tmp_path, "ref")
        reference = subprocess.run(ref_cmd, env=_env(tmp_path / "jax-cache"), cwd=REPO, capture_output=True, text=True)
        assert reference.returncode == 0, reference.stderr[-3000:]
        supervisor.wait(timeout=180)
    finally:
        supervisor.kill()
    elapsed = time.monotonic() - t0
    err = err_path.read_text()
    # Orbax warns once per save; the supervisor's lines and any traceback are what explain a failure
    told = "\n".join(line for line in err.splitlines() if "WARNING:absl" not in line)[-4000:]
    assert supervisor.returncode == 0, told
    assert err.count("; restart ") == KILLS, told

    starts, got = _read(log)
    _, want = _read(tmp_path / "ref.log")
    assert [s for _, s, *_ in want] == list(range(1, STEPS + 1))
    assert [a for a, _ in starts] == [str(i) for i in range(KILLS + 1)]
    by_attempt: dict[str, list[tuple[int, str, str]]] = {}
    for a, s, ids, loss in got:
        by_attempt.setdefault(a, []).append((s, ids, loss))
    counted: dict[int, tuple[str, str]] = {}
    redone = 0
    for i in range(KILLS + 1):
        rows = by_attempt.get(str(i), [])
        if not rows:  # killed before its first step
            continue
        first = rows[0][0]
        assert [s for s, *_ in rows] == list(range(first, first + len(rows))), f"attempt {i} skipped a step"
        previous_last = max(counted) if counted else 0
        assert first - 1 <= previous_last, f"attempt {i} resumed after step {first - 1}, past the last applied"
        assert (first - 1) % EVERY == 0, f"attempt {i} resumed at {first - 1}, not a checkpoint step"
        for s, ids, loss in rows:
            if s in counted:
                redone += 1
                assert counted[s] == (ids, loss), f"step {s} redone by attempt {i} with other samples or loss"
        for s in [s for s in counted if s >= first]:  # rolled back: those applications no longer count
            del counted[s]
        counted.update({s: (ids, loss) for s, ids, loss in rows})
    assert sorted(counted) == list(range(1, STEPS + 1)), "a step was lost"
    assert [counted[s] for s in range(1, STEPS + 1)] == [(ids, loss) for _, _, ids, loss in want]
    samples = [int(x) for s in range(1, STEPS + 1) for x in counted[s][0].split(",")]
    assert all(sorted(samples[e * 48 : (e + 1) * 48]) == list(range(48)) for e in range(len(samples) // 48))

    a, b = np.load(tmp_path / "soak.npz"), np.load(tmp_path / "ref.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 5
    for name in a.files:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    during = sum(d for _, _, d, _ in kills)
    print(
        f"\nsoak: {len(kills)} kills ({during} during a save; modes {[m for _, m, _, _ in kills]}), "
        f"{redone} steps redone after rollbacks, kill points {[s for *_, s in kills]}, "
        f"crc of final params {zlib.crc32(b''.join(a[n].tobytes() for n in sorted(a.files))):08x}, {elapsed:.0f}s"
    )
    assert during >= 1, kills


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
