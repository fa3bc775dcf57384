"""The second tier: committed checkpoint steps copied to object storage (``s3://``, ``gs://``, any fsspec URL) or
a path, and fetched back onto a machine whose local disk was lost.

The replica is reached through fsspec (``pip install openhosti_jax[s3]`` for s3fs, ``[gcs]`` for gcsfs), the
client stack users run; a URL whose package is missing, or a scheme fsspec does not know, is a `ConfigError`
naming the fix. Object stores have no atomic rename (a rename is a copy and a delete), so a replica step is
committed by what is copied last: the step's checksum records. A step counts as complete only when every process's
record is there (`openhosti_jax.checkpoint.checksums.records_complete`), so a reader never takes a half-copied step
for a good one: one cut short (a kill mid-upload, a lost connection) is skipped and removed by the next copy. The
data files are copied ``threads`` at a time; the checksums travel with them and are verified when the step is
restored. Steps beyond ``keep`` are pruned, and so are incomplete ones older than the newest complete step.

With per-process local directories (no shared filesystem), each process uploads its share of the merged step
with `replicate_files`, its record of exactly that share last: the step is complete when every process's record
is in, so the commit needs no coordination (see `openhosti_jax.checkpoint.local`).

Example:
    >>> import pathlib, tempfile
    >>> from openhosti_jax.checkpoint.checksums import record_name
    >>> src, dst = pathlib.Path(tempfile.mkdtemp()), pathlib.Path(tempfile.mkdtemp())
    >>> (src / "7" / "state").mkdir(parents=True); _ = (src / "7" / "state" / "a").write_text("x")
    >>> _ = (src / "7" / record_name(0, 1)).write_text("{}")
    >>> replicate_step(src / "7", dst, keep=2); replica_steps(dst)
    [7]
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openhosti_jax.checkpoint.checksums import is_record, record_name, records_complete
from openhosti_jax.checkpoint.trust import is_step_name, path_problem, sign_record
from openhosti_jax.errors import CheckpointCorruptError, CheckpointError, ConfigError

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def replica_fs(dest: str | os.PathLike[str]) -> tuple[Any, str]:
    """(the fsspec filesystem, the path on it) of a replica location; `ConfigError` for an unknown scheme or a
    missing client package (naming the extra to install)."""
    import fsspec

    url = os.fspath(dest)
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:
        extra = _EXTRAS.get(scheme, scheme)
        raise ConfigError(
            f"replicate_to={url!r}: the {scheme}:// client is not installed ({e}); pip install 'openhosti_jax[{extra}]'"
        ) from e
    except ValueError as e:
        raise ConfigError(
            f"replicate_to={url!r}: expected a path or a URL fsspec knows (s3://, gs://, file://, ...), found the "
            f"scheme {scheme!r} ({e})"
        ) from e
    return fs, path.rstrip("/")


def _names(fs: Any, path: str) -> list[str]:
    return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]


def step_folders(dest: str | os.PathLike[str]) -> list[int] | None:
    """The step folders under ``dest``, complete or not, ascending; None where ``dest`` does not exist."""
    fs, root = replica_fs(dest)
    if not fs.exists(root):
        return None
    return sorted(int(n) for n in _names(fs, root) if is_step_name(n) and fs.isdir(f"{root}/{n}"))


def replica_steps(dest: str | os.PathLike[str]) -> list[int]:
    """The complete steps under ``dest`` (every process's checksum record copied), ascending."""
    fs, root = replica_fs(dest)
    return [s for s in step_folders(dest) or [] if records_complete(_names(fs, f"{root}/{s}"))]


def replica_reachable(dest: str | os.PathLike[str]) -> None:
    """Write, read and delete a probe under ``dest`` so that credentials or an endpoint that do not work are
    reported before training starts, not at the first save (`ConfigError` saying what failed). An object store's
    bucket must exist already: it is never created here (a typo would otherwise make a new bucket)."""
    fs, root = replica_fs(dest)
    url = os.fspath(dest)
    probe = f"{root}/.openhosti-probe-{os.getpid()}"
    problem, cause = None, None
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    bucket = root.strip("/").split("/", 1)[0] if set(protocols) & set(_EXTRAS) else None
    try:
        if bucket is not None and not _bucket_exists(fs, bucket):
            raise ConfigError(
                f"replicate_to={url!r}: expected the bucket {bucket!r} to exist, found no such bucket (or none these "
                f"credentials may see); create it first (`aws s3 mb s3://{bucket}`, `gcloud storage buckets create "
                f"gs://{bucket}`) or fix the name"
            )
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"ok")
        if fs.cat_file(probe) != b"ok":
            problem = "a probe that read back differently"
        fs.rm_file(probe)
    except ConfigError:
        raise
    except PermissionError as e:
        problem, cause = f"the store refused these credentials ({type(e).__name__}: {str(e)[:300]})", e
    except Exception as e:  # noqa: BLE001 - any client failure (credentials, endpoint, permissions) is said once
        problem, cause = f"{type(e).__name__}: {str(e)[:300]}", e
    if problem is not None:
        raise ConfigError(
            f"replicate_to={url!r}: expected a location this process can write, read and delete in, "
            f"found {problem}; check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE, "
            "GOOGLE_APPLICATION_CREDENTIALS), the endpoint and the bucket"
        ) from cause


def _bucket_exists(fs: Any, bucket: str) -> bool:
    """Whether the object store has ``bucket``; a refusal (`PermissionError`: the credentials) is raised."""
    try:
        fs.info(bucket)
    except FileNotFoundError:
        return False
    return True


def _local_files(root: str) -> list[str]:
    """Every file under the local folder ``root``, relative to it (``/``-separated). A symbolic link is never
    followed: a step folder holding one is not uploaded (`CheckpointCorruptError` naming it), so no byte from
    outside the step reaches the replica."""
    out, links = [], []
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        for name in dirs + files:
            if os.path.islink(os.path.join(folder, name)):
                links.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
        out += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in files]
    if links:
        raise CheckpointCorruptError(
            f"expected only files and folders in the step {root}, found symbolic links {sorted(links)[:5]}; the step "
            "is not copied to the replica (Orbax writes no links: something else put them there)"
        )
    return sorted(out)


def replicate_step(
    step_dir: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    keep: int | None,
    threads: int = 8,
    gate: Callable[[], object] | None = None,
) -> None:
    """Copy the local ``step_dir`` to ``dest/<its name>``, data files first (``threads`` at a time) and its
    checksum records last (the commit), then keep only the newest ``keep`` complete steps there."""
    fs, root = replica_fs(dest)
    step_dir = os.fspath(step_dir)
    final = f"{root}/{os.path.basename(step_dir.rstrip('/'))}"
    if fs.exists(final):  # an earlier copy cut short (or a stale one): start again
        fs.rm(final, recursive=True)
    files = _local_files(step_dir)
    data = [f for f in files if not ("/" not in f and is_record(f))]
    records = [f for f in files if f not in data]

    _upload(fs, step_dir, final, data, threads, gate)
    _upload(fs, step_dir, final, records, 1)  # the commit: with every record present the step counts as complete
    prune(dest, keep)


def _upload(
    fs: Any, step_dir: str, final: str, files: list[str], threads: int, gate: Callable[[], object] | None = None
) -> None:
    def put(rel: str) -> None:
        if gate is not None:  # e.g. hold back while the training thread copies a new save off the devices
            gate()
        target = f"{final}/{rel}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(os.path.join(step_dir, rel), target)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(put, files))


def replicate_files(
    step_dir: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    files: list[str],
    *,
    process: int,
    process_count: int,
    unrecorded: Sequence[str] = (),
    before_commit: Callable[[bool], bool] = lambda uploaded: uploaded,
    threads: int = 8,
    gate: Callable[[], object] | None = None,
    key: bytes | None = None,
) -> bool:
    """Upload process ``process``'s share ``files`` (relative to its local ``step_dir``) into ``dest/<step>``,
    with the ``unrecorded`` files no record covers (Orbax's own), then its checksum record of exactly ``files``
    (the entries of its local record), last; True if the record was written.

    An earlier record of this process there is deleted first. ``before_commit(uploaded)`` is called whether or not
    the upload succeeded and says whether to write the record: `CheckpointManager` passes an exchange through
    the coordinator, so no process writes its record before every process's old record is gone and its share is
    in (a step re-copied after a crash never completes with one process's stale share).
    """
    fs, root = replica_fs(dest)
    step_dir = os.fspath(step_dir)
    final = f"{root}/{os.path.basename(step_dir.rstrip('/'))}"
    name = record_name(process, process_count)
    with open(os.path.join(step_dir, name)) as f:
        body = json.load(f)
    _local_files(step_dir)  # refuses a folder with symbolic links
    missing = sorted(set(files) - set(body["files"]))
    if missing:
        raise CheckpointError(
            f"expected every file of process {process}'s replica share in its record {name}, found {missing[:5]} "
            "unrecorded; the step's local folder changed after it was checksummed"
        )
    uploaded = False
    try:
        if fs.exists(f"{final}/{name}"):
            fs.rm_file(f"{final}/{name}")
        _upload(fs, step_dir, final, sorted(files) + list(unrecorded), threads, gate)
        uploaded = True
    finally:  # the others wait for this process's word, uploaded or not
        commit = before_commit(uploaded)
    if not commit:
        return False
    body["files"] = {rel: body["files"][rel] for rel in sorted(files)}
    fs.pipe_file(f"{final}/{name}", json.dumps(sign_record(body, key)).encode())
    return True


def fetch_step(dest: str | os.PathLike[str], step: int, local: str | os.PathLike[str], threads: int = 8) -> str:
    """Copy the complete replica step ``dest/<step>`` into the local directory ``local`` (a machine whose disk was
    lost gets its tier back) and return its path there. It lands in a fresh folder (``tempfile.mkdtemp`` inside
    ``local``) and is renamed when whole (a local rename is atomic), so a fetch cut short never looks like a step.

    Every object key is checked first (`openhosti_jax.checkpoint.trust.path_problem`): a key that would land
    outside the step (``../``, an absolute path) makes the step corrupt (`CheckpointCorruptError` naming the key)
    and nothing is written.
    """
    fs, root = replica_fs(dest)
    src = f"{root}/{int(step)}"
    local = os.fspath(local)
    final = os.path.join(local, str(int(step)))
    files = []
    for key in fs.find(src):
        rel = key[len(src) + 1 :] if key.startswith(src + "/") else None
        why = "is not under the step's prefix" if rel is None else path_problem(rel)
        if why is None and callable(getattr(fs, "islink", None)) and fs.islink(key):
            why = "is a symbolic link"
        if why is not None:
            raise CheckpointCorruptError(
                f"expected every object of replica step {src} to be a path inside the step, found the key {key!r}, "
                f"which {why}; the step is not fetched (someone who can write to the bucket planted it?)"
            )
        files.append(rel)
    os.makedirs(local, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{int(step)}.fetching-", dir=local)

    def get(rel: str) -> None:
        target = os.path.join(tmp, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(f"{src}/{rel}", target)

    try:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(get, files))
        os.chmod(tmp, 0o755)  # private while it is fetched (mkdtemp's 0700), a step folder like any other after
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:  # another process sharing this directory put the same step there first
        shutil.rmtree(tmp, ignore_errors=True)
        if not records_complete(os.listdir(final)):
            raise
    return final


def prune(dest: str | os.PathLike[str], keep: int | None) -> None:
    """Remove complete steps beyond the newest ``keep`` and incomplete ones older than the newest complete step."""
    fs, root = replica_fs(dest)
    complete = replica_steps(dest)
    if not complete:
        return
    drop = set(complete[:-keep] if keep else [])
    drop |= {s for s in step_folders(dest) or [] if s < complete[-1]} - set(complete)
    for step in sorted(drop):
        fs.rm(f"{root}/{step}", recursive=True)
