"""Untrusted-input matrix: what someone who can write to the checkpoint directory, the bucket or the coordinator's
key-value store, or who types a command line, can hand the library; is each one handled?

Handled means, for each kind:

- **checkpoint** (a crafted checksum record, an unlisted meta file, symbolic links, a tampered file with a rewritten
  CRC under an HMAC key, ``.zarray`` or marker files linked to ``/dev/zero``): restore falls back to the intact older
  step, bit for bit, with a warning, within the case's timeout (no hang, no raw exception).
- **bucket** (keys with ``../`` or a backslash planted in a committed replica step): the fetch refuses the step
  (`CheckpointCorruptError` naming the key), writes nothing outside the checkpoint directory, and a fresh machine
  resumes from the older step bit for bit.
- **folders** (step folders named ``²``, ``012``, ``-1``, ``٣``, ``1e3``): listed neither locally nor in the replica,
  rotation and restore work around them.
- **upload**: a step holding a symbolic link is not copied to the replica.
- **key-value store** (a foreign key, an id out of range, a non-string, non-JSON, a non-ASCII digit): a
  `DistributedError` naming the key.
- **command line** (every ``openhosti`` subcommand, at least 5 malformed lines each): a non-zero exit with a one-line
  ``openhosti <command>: ...`` (or argparse's) error, no traceback, no hang (60 s each).

Prints one JSON object on its last line (keys and goals in benchmarks/README.md); ``--quick`` runs every case too.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
import zlib

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CASE_TIMEOUT_S = 60


class Hang(Exception):
    pass


def _alarm(*_):
    raise Hang()


def _state(step: int):
    import jax.numpy as jnp

    return {"w": jnp.arange(64, dtype=jnp.float32) * step, "step": jnp.int32(step)}


def _abstract():
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))


def _save(directory, **kw):
    from openhosti_jax.checkpoint import CheckpointManager

    with CheckpointManager(directory, every_minutes=None, **kw) as ckpt:
        for s in (2, 4):
            ckpt.maybe_save(s, _state(s), force=True)


def _falls_back(directory, **kw) -> str | None:
    """None if restore falls back to step 2 bit for bit with a warning, else what happened."""
    import numpy as np

    from openhosti_jax.checkpoint import CheckpointManager

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with CheckpointManager(directory, every_minutes=None, **kw) as ckpt:
            restored, _, _ = ckpt.restore(_abstract())
            step = ckpt.restored_step
    if step != 2:
        return f"restored step {step}"
    if not any("step 4" in str(w.message) for w in said):
        return "no warning named step 4"
    if not np.array_equal(np.asarray(restored["w"]), np.asarray(_state(2)["w"])):
        return "restored different bytes"
    return None


def _record(step_dir):
    from openhosti_jax.checkpoint.checksums import record_files

    (path,) = record_files(step_dir)
    return path


def _edit(step_dir, edit):
    path = _record(step_dir)
    body = json.loads(path.read_text())
    edit(body)
    path.write_text(json.dumps(body))


def _first(files, prefix):
    return next(k for k in sorted(files) if k.startswith(prefix))


def _chunk(step_dir):
    return next(p for p in (step_dir / "state" / "w").iterdir() if not p.name.startswith("."))


RECORDS = {
    "record: ../ to /dev/zero": lambda b, d: b["files"].update({"meta/../../dev/zero": [10**12, 0]}),
    "record: absolute /etc/hostname": lambda b, d: b["files"].update({"/etc/hostname": [5, 0]}),
    "record: size as a string": lambda b, d: b["files"].update({_first(b["files"], "state/"): ["8", 0]}),
    "record: empty entry": lambda b, d: b["files"].update({_first(b["files"], "state/"): []}),
    "record: unknown algorithm": lambda b, d: b.update(algorithm="md5"),
    "record: files not an object": lambda b, d: b.update(files=[1, 2]),
    "record: file outside the items": lambda b, d: b["files"].update({"other/x": [1, 0]}),
    "record: negative size": lambda b, d: b["files"].update({_first(b["files"], "state/"): [-1, 0]}),
    "record: checksum past 32 bits": lambda b, d: b["files"].update({_first(b["files"], "state/"): [1, 2**40]}),
}


def checkpoint_cases(tmp):
    """(name, function returning None when handled else what happened)."""
    import pathlib

    cases = []
    for name, edit in RECORDS.items():

        def run(name=name, edit=edit):
            d = pathlib.Path(tempfile.mkdtemp(dir=tmp))
            _save(d)
            _edit(d / "4", lambda b: edit(b, d))
            return _falls_back(d)

        cases.append((name, run))

    def unlisted_meta():
        d = pathlib.Path(tempfile.mkdtemp(dir=tmp))
        _save(d)
        (d / "4" / "meta" / "planted").write_text("{}")
        return _falls_back(d)

    def linked(target_of):
        def run():
            d = pathlib.Path(tempfile.mkdtemp(dir=tmp))
            _save(d)
            victim = target_of(d / "4")
            outside = d.parent / f"outside-{d.name}"
            outside.write_bytes(victim.read_bytes())
            victim.unlink()
            victim.symlink_to(outside)
            return _falls_back(d)

        return run

    def to_dev_zero(rel):
        def run():
            d = pathlib.Path(tempfile.mkdtemp(dir=tmp))
            _save(d)
            path = d / "4" / rel
            path.unlink(missing_ok=True)
            path.symlink_to("/dev/zero")
            return _falls_back(d)

        return run

    def hmac_tamper():
        key = "a secret"
        d = pathlib.Path(tempfile.mkdtemp(dir=tmp))
        _save(d, key=key)
        chunk = _chunk(d / "4")
        data = bytearray(chunk.read_bytes())
        data[-1] ^= 0xFF
        chunk.write_bytes(bytes(data))
        rel = chunk.relative_to(d / "4").as_posix()

        def edit(body):  # the CRC rewritten to match, as an attacker would
            body["algorithm"] = "crc32"
            for other in body["files"]:
                body["files"][other] = [(d / "4" / other).stat().st_size, zlib.crc32((d / "4" / other).read_bytes())]
            body["files"][rel] = [len(data), zlib.crc32(bytes(data))]

        _edit(d / "4", edit)
        return _falls_back(d, key=key)

    cases += [
        ("meta file the record does not list", unlisted_meta),
        ("symlink for a chunk file", linked(_chunk)),
        ("symlink for a meta file", linked(lambda s: next(p for p in (s / "meta").rglob("*") if p.is_file()))),
        (".zarray linked to /dev/zero", to_dev_zero("state/w/.zarray")),
        ("checksum record linked to /dev/zero", to_dev_zero(_record_name())),
        ("tampered file, CRC rewritten, HMAC key set", hmac_tamper),
    ]
    return cases


def _record_name():
    from openhosti_jax.checkpoint.checksums import record_name

    return record_name(0, 1)


def bucket_cases(tmp):
    import pathlib

    import fsspec
    import numpy as np

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.checkpoint.replicate import fetch_step, replicate_step
    from openhosti_jax.errors import CheckpointCorruptError

    def planted(key_tail):
        def run():
            url = f"memory://untrusted-{os.getpid()}-{time.monotonic_ns()}/run"
            base = pathlib.Path(tempfile.mkdtemp(dir=tmp))
            _save(base / "first", replicate_to=url)
            fs, root = fsspec.core.url_to_fs(url)
            fs.pipe_file(f"{root}/4/{key_tail}", b"planted")
            fresh = base / "fresh" / "ckpt"
            try:
                fetch_step(url, 4, fresh)
                return "the fetch took the step"
            except CheckpointCorruptError as e:
                if key_tail not in str(e) and repr(key_tail)[1:-1] not in str(e):
                    return f"the error does not name the key: {e}"
            escaped = [p for p in base.rglob("*") if p.name == "escaped" or "planted" in p.name]
            if escaped:
                return f"written outside: {escaped}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with CheckpointManager(fresh, every_minutes=None, replicate_to=url) as ckpt:
                    restored, _, _ = ckpt.restore(_abstract())
                    step = ckpt.restored_step
            fs.rm(root.split("/")[1] if root.startswith("/") else root.split("/")[0], recursive=True)
            same = np.array_equal(np.asarray(restored["w"]), np.asarray(_state(2)["w"]))
            return None if step == 2 and same else f"resumed step {step}"

        return run

    def upload_link():
        d = pathlib.Path(tempfile.mkdtemp(dir=tmp))
        _save(d / "ckpt")
        chunk = _chunk(d / "ckpt" / "4")
        (d / "secret").write_bytes(b"not the checkpoint's")
        chunk.unlink()
        chunk.symlink_to(d / "secret")
        try:
            replicate_step(d / "ckpt" / "4", d / "replica", keep=None)
        except CheckpointCorruptError:
            return None if not (d / "replica" / "4").exists() else "a partial copy was left"
        return "the link was uploaded"

    return [
        ("bucket key ../../../escaped", planted("../../../escaped")),
        ("bucket key ..\\..\\escaped", planted("..\\..\\escaped")),
        ("bucket key meta/../../escaped", planted("meta/../../escaped")),
        ("upload of a step holding a symlink", upload_link),
    ]


def folder_cases(tmp):
    import pathlib

    from openhosti_jax.checkpoint import CheckpointManager
    from openhosti_jax.checkpoint.replicate import replica_steps

    def odd(name):
        def run():
            d = pathlib.Path(tempfile.mkdtemp(dir=tmp))
            _save(d / "ckpt")
            _save(d / "replica")
            (d / "ckpt" / name).mkdir()
            (d / "replica" / name).mkdir()
            if replica_steps(d / "replica") != [2, 4]:
                return f"replica steps {replica_steps(d / 'replica')}"
            with CheckpointManager(d / "ckpt", every_minutes=None, keep=2) as ckpt:
                ckpt.maybe_save(6, _state(6), force=True)
                ckpt.wait()
                good = ckpt.good_steps()
                ckpt.restore(_abstract())
                step = ckpt.restored_step
            return None if good == [4, 6] and step == 6 and (d / "ckpt" / name).exists() else f"good {good}"

        return run

    return [(f"step folder {n!r}", odd(n)) for n in ("²", "012", "-1", "٣", "1e3")]


def store_cases():
    from openhosti_jax.errors import DistributedError
    from openhosti_jax.mesh import barrier

    class Store:
        def __init__(self, planted):
            self.data, self.planted = {}, planted

        def key_value_set(self, key, value):
            self.data[key] = value

        def key_value_dir_get(self, directory):
            return [(k, v) for k, v in self.data.items() if k.startswith(directory)] + [
                (directory + k, v) for k, v in self.planted
            ]

    def case(planted):
        def run():
            real = (barrier._client, barrier.jax.process_count, barrier.jax.process_index)
            barrier._client = lambda: Store(planted)
            barrier.jax.process_count, barrier.jax.process_index = (lambda: 2), (lambda: 0)
            try:
                barrier.gathered("probe", 1, timeout_s=1)
                return "accepted"
            except DistributedError as e:
                return None if "expected" in str(e) else str(e)
            finally:
                barrier._client, barrier.jax.process_count, barrier.jax.process_index = real

        return run

    return [
        ("store: a foreign key", case([("one", "1")])),
        ("store: a process id out of range", case([("7", "1")])),
        ("store: a value that is not a string", case([("1", None)])),
        ("store: a value that is not JSON", case([("1", "{not json")])),
        ("store: a non-ASCII digit id", case([("²", "1")])),
    ]


_LLAMA = ["--model", "llama3-8b", "--global-batch", "8"]
COMMAND_LINES = {
    "train": [
        ["--lr", "nan"],
        ["--lr", "-1"],
        ["--steps", "0"],
        ["--batch", "abc"],
        ["--plan", "zero9"],
        ["--seq-len", "0"],
        ["--devices", "100000"],
        ["--profile-steps", "5:2", "--run-dir", "RUN"],
        ["--checkpoint-every", "-3"],
        ["--checkpoint-dir", "FILE"],
        ["--replicate-to", "nosuch://x/y", "--checkpoint-dir", "DIR"],
    ],
    "plan": [
        ["--example", "nosuch"],
        ["--devices", "0"],
        ["--devices", "x"],
        ["--memory-budget", "-5"],
        ["--devices", "100000"],
    ],
    "predict": [
        ["--cluster", "8000000000000000000000xH100", *_LLAMA],
        ["--cluster", "0xH100", *_LLAMA],
        ["--cluster", "99999x99999xH100", *_LLAMA],
        ["--cluster", "8xH100", "--model", "llama3-8b", "--global-batch", "²"],
        ["--cluster", "8xH100", *_LLAMA, "--seq", "0"],
        ["--cluster", "8xH100", "--global-batch", "8", "--model", "nosuch"],
        ["--cluster", "v5p-99999999999", *_LLAMA],
        ["--cluster", "8xH100", *_LLAMA, "--layers", "4"],
        ["--cluster", "8xH100", *_LLAMA, "--zero", "2"],
        ["--cluster", "8xH100", "--model", "llama3-8b", "--global-batch", "0tok"],
        ["--cluster", "8xH100", *_LLAMA, "--mesh", "garbage"],
        ["--cluster", "8xH100", *_LLAMA, "--memory-budget", "nan"],
    ],
    "report": [
        ["/nonexistent/run"],
        ["BAD_JSON"],
        ["BAD_LIST"],
        ["BAD_FIELD"],
        ["BAD_JSON", "--stages", "0"],
        ["BAD_JSON", "--schedule", "nosuch"],
        ["FILE"],
    ],
    "bench": [["../x"], ["/tmp/x"], ["nosuch"], ["goals"], [""], ["checkpoint/../planner"]],
    "launch": [
        ["-n", "0", "--", "true"],
        ["-n", "2"],
        ["-n", "x", "--", "true"],
        ["-n", "2", "--port", "70000", "--", "true"],
        ["-n", "100000", "--", "true"],
        ["-n", "2", "--local-devices", "0", "--", "true"],
    ],
    "run": [
        ["--max-backoff-s", "nan", "--", "true"],
        ["--backoff-s", "-1", "--", "true"],
        ["--max-restarts", "-1", "--", "true"],
        ["--backoff-factor", "0.5", "--", "true"],
        ["--reset-after-s", "0", "--", "true"],
        [],
    ],
}


def command_cases(tmp):
    from openhosti_jax.cli import main

    files = {
        "BAD_JSON": '{"step": 1, "loss": 2.0}\n{"step": 2, "lo',
        "BAD_LIST": "[1, 2]\n",
        "BAD_FIELD": '{"step": "x", "loss": "y"}\n',
    }
    places = {"RUN": os.path.join(tmp, "run"), "DIR": os.path.join(tmp, "dir"), "FILE": os.path.join(tmp, "file")}
    with open(places["FILE"], "w") as f:
        f.write("a file, not a folder")
    for name, text in files.items():
        places[name] = os.path.join(tmp, name)
        os.makedirs(places[name], exist_ok=True)
        with open(os.path.join(places[name], "metrics.jsonl"), "w") as f:
            f.write(text)

    def case(line):
        def run():
            err, out = io.StringIO(), io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                rc = main(line)
            lines = err.getvalue().strip().splitlines()
            if rc in (0, None):
                return f"exit {rc}"
            if not lines or "Traceback" in err.getvalue():
                return "no message, or a traceback"
            if not lines[-1].startswith((f"openhosti {line[0]}: ", "openhosti: error:")):
                return f"last line {lines[-1][:120]!r}"
            return None

        return run

    return [
        (f"openhosti {cmd} {' '.join(args)}"[:90], case([cmd, *[places.get(a, a) for a in args]]))
        for cmd, lines in COMMAND_LINES.items()
        for args in lines
    ]


def main():
    import goals

    signal.signal(signal.SIGALRM, _alarm)
    results = {}
    with tempfile.TemporaryDirectory(prefix="openhosti-untrusted-") as tmp:
        groups = {
            "checkpoint": checkpoint_cases(tmp),
            "bucket": bucket_cases(tmp),
            "folders": folder_cases(tmp),
            "store": store_cases(),
            "command_line": command_cases(tmp),
        }
        for group, cases in groups.items():
            for name, run in cases:
                t0 = time.monotonic()
                signal.alarm(CASE_TIMEOUT_S)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        problem = run()
                except Hang:
                    problem = f"no answer within {CASE_TIMEOUT_S} s"
                except BaseException as e:  # noqa: BLE001 - a raw exception is a case not handled
                    problem = f"raised {type(e).__name__}: {str(e)[:200]}"
                finally:
                    signal.alarm(0)
                results[name] = {"group": group, "handled": problem is None, "problem": problem}
                mark = "ok  " if problem is None else "FAIL"
                print(f"{mark} {time.monotonic() - t0:5.1f}s {group:<12} {name} {problem or ''}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
    per_command = {}
    for name, r in results.items():
        if r["group"] == "command_line":
            cmd = name.split()[1]
            per_command[cmd] = per_command.get(cmd, 0) + 1
    handled = sum(r["handled"] for r in results.values())
    out = {
        "untrusted_inputs_tried": len(results),
        "untrusted_inputs_handled_over_tried": handled / len(results),
        "malformed_lines_per_subcommand": per_command,
        "not_handled": {k: r["problem"] for k, r in results.items() if not r["handled"]},
    }
    goals.emit(out, __file__)


if __name__ == "__main__":
    main()
