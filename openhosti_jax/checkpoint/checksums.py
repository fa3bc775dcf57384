"""Per-process checksums of a committed checkpoint step, and their verification.

Orbax restores a file with a flipped byte without complaint. After a step is committed, every process reads
back the files it wrote and records them as ``[size, checksum]`` in its own ``<step>/openhosti_checksums.<p>-of-
<n>.json`` (written last, atomically), with the checksum's ``algorithm``: CRC-32C (Castagnoli, hardware-accelerated
by ``google-crc32c``, about 3x zlib's CRC-32 here) when its compiled extension is present, else zlib's CRC-32.
A record names its algorithm, so every step verifies with the one it was written with. A step counts as
checksummed once all ``n`` records exist.

Which process wrote which file (Orbax 0.12, zarr without OCDBT): ``state/<name>/<i.j>`` is the chunk of the
array ``<name>`` at chunk-grid index ``(i, j)``; a shard held by ``R`` devices is cut into pieces along one
axis and replica ``r`` writes piece ``r`` (replica ids counted as `jax` counts them); a shard written whole
is written by replica 0. ``state/array_metadatas/process_<p>`` is process ``p``'s; every other file
(``.zarray``, ``_METADATA``, the ``data`` and ``meta`` items) is process 0's, and process 0 also takes any
file this rule does not place, so the records together cover every file of the step.

A restore verifies only the files its process reads: the metadata files and the chunks that overlap the
shards it restores onto, ``threads`` files at a time (both checksums release the GIL on large buffers). A flipped
byte (a 32-bit CRC catches every error burst up to 32 bits), a truncated file (size) or a deleted file (missing) is
reported under the name of the array it belongs to.

Example:
    >>> import pathlib, tempfile
    >>> from openhosti_jax.checkpoint.checksums import has_checksums, record_checksums, verify_checksums
    >>> step = pathlib.Path(tempfile.mkdtemp())
    >>> (step / "state" / "w").mkdir(parents=True); _ = (step / "state" / "w" / "0").write_bytes(b"abc")
    >>> record_checksums(step)["state/w/0"][0], has_checksums(step), verify_checksums(step)
    (3, True, [])
    >>> _ = (step / "state" / "w" / "0").write_bytes(b"abd"); verify_checksums(step)
    ["array 'w': file state/w/0 has checksum ... (recorded ...)"]
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from etils import epath

try:  # CRC-32C in hardware (SSE4.2 / ARMv8 CRC); the pure-Python fallback would be far slower than zlib
    import google_crc32c

    _CRC32C = google_crc32c.implementation == "c"
except ImportError:  # pragma: no cover - a core dependency; zlib's CRC-32 then
    google_crc32c = None
    _CRC32C = False

from openhosti_jax.checkpoint.trust import file_problem, parse_record, path_problem, sign_record
from openhosti_jax.errors import CheckpointError

RECORD_PREFIX = "openhosti_checksums"
LEGACY_RECORD = RECORD_PREFIX + ".json"
"""The single record of a step written before records were per process; still read."""
_RECORD_RE = re.compile(re.escape(RECORD_PREFIX) + r"\.([0-9]{1,9})-of-([0-9]{1,9})\.json\Z")
_PROCESS_FILE_RE = re.compile(r"state/array_metadatas/process_([0-9]{1,9})\Z")
_MAX_RECORD = 1 << 28
"""A checksum record larger than this (256 MiB) is not read: no step has that many files."""
_ITEMS = ("state", "data", "meta")
_CHUNK = 4 << 20
Box = tuple[tuple[int, int], ...]


ALGORITHM = "crc32c" if _CRC32C else "crc32"
"""The checksum new records use."""


def _extender(algorithm: str) -> Callable[[int, Any], int]:
    if algorithm == "crc32":
        return lambda crc, chunk: zlib.crc32(chunk, crc)
    if algorithm == "crc32c" and google_crc32c is not None:
        return lambda crc, chunk: google_crc32c.extend(crc, bytes(chunk) if isinstance(chunk, memoryview) else chunk)
    raise CheckpointError(
        f"expected a checksum algorithm of 'crc32' or 'crc32c', found {algorithm!r} (or crc32c without the "
        "google-crc32c package); pip install google-crc32c"
    )


def default_threads() -> int:
    """How many files are checksummed at once: the CPU count, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def record_name(process: int, process_count: int) -> str:
    """The file name of process ``process``'s record (``openhosti_checksums.<p>-of-<n>.json``)."""
    return f"{RECORD_PREFIX}.{process}-of-{process_count}.json"


def record_files(step_dir: str | os.PathLike[str]) -> list[epath.Path]:
    """Every checksum record file of the step (per-process and legacy)."""
    step_dir = epath.Path(step_dir)
    if not step_dir.exists():
        return []
    return [p for p in step_dir.iterdir() if is_record(p.name)]


def is_record(name: str) -> bool:
    """Whether a file name is a checksum record's."""
    return name == LEGACY_RECORD or _RECORD_RE.match(name) is not None


def records_complete(names: set[str] | list[str]) -> bool:
    """Whether the file names of a step's folder include every process's checksum record.

    Example:
        >>> records_complete([record_name(0, 2), "state"]), records_complete([record_name(0, 2), record_name(1, 2)])
        (False, True)
    """
    if LEGACY_RECORD in names:
        return True
    found: dict[int, set[int]] = {}
    for name in names:
        m = _RECORD_RE.match(name)
        if m is not None:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    return any(procs == set(range(n)) for n, procs in found.items())


def has_checksums(step_dir: str | os.PathLike[str]) -> bool:
    """Whether every process's checksum record of the step was written (the step is committed and checksummed)."""
    return records_complete({p.name for p in record_files(step_dir)})


COMPLETE_MARKER = "openhosti_complete.json"
"""Written in a process's own step folder (per-process directories, `openhosti_jax.checkpoint.local`) once every
process recorded the step, agreed through the coordinator: with it, that process's record alone completes the step."""


def locally_complete(step_dir: str | os.PathLike[str]) -> bool:
    """Whether a per-process step folder has its process's record and `COMPLETE_MARKER`."""
    step_dir = epath.Path(step_dir)
    if file_problem(step_dir, COMPLETE_MARKER) is not None:  # missing, or planted as a link or a device
        return False
    try:
        body = json.loads((step_dir / COMPLETE_MARKER).read_text())
        name = record_name(int(body["process"]), int(body["process_count"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return any(p.name == name for p in record_files(step_dir))


def missing_records(step_dir: str | os.PathLike[str], process_count: int) -> list[int]:
    """The processes (of ``process_count``) whose record of the step does not exist yet."""
    names = {p.name for p in record_files(step_dir)}
    return [p for p in range(process_count) if record_name(p, process_count) not in names]


_BUFFERS = threading.local()


def _crc_file(
    path: epath.Path,
    pace: Callable[[float], None] | None = None,
    algorithm: str = ALGORITHM,
    limit: int | None = None,
) -> tuple[int, int]:
    """(size, checksum) of the file; with ``limit`` (the recorded size) reading stops one byte past it."""
    extend = _extender(algorithm)
    buf = getattr(_BUFFERS, "buf", None)
    if buf is None:  # one reused buffer per thread: no fresh pages to fault in for every chunk
        buf = _BUFFERS.buf = memoryview(bytearray(_CHUNK))
    crc, size = 0, 0
    with path.open("rb") as f:
        readinto = getattr(f, "readinto", None) if algorithm == "crc32" else None  # crc32c takes bytes only
        while True:
            t0 = time.perf_counter()
            want = _CHUNK if limit is None else min(_CHUNK, limit + 1 - size)
            if want <= 0:
                return size, crc  # longer than recorded: the size says so, nothing more is read
            if readinto is not None:
                n = readinto(buf[:want])
                chunk = buf[:n]
            else:
                chunk = f.read(want)
                n = len(chunk)
            if not n:
                return size, crc
            crc = extend(crc, chunk)
            size += n
            if pace is not None:
                pace(time.perf_counter() - t0)


def _crc_many(
    step_dir: epath.Path,
    rels: list[str],
    threads: int | None,
    pace: Callable[[float], None] | None = None,
    algorithms: dict[str, str] | None = None,
    limits: dict[str, int] | None = None,
) -> dict[str, tuple[int, int] | None]:
    """``{rel: (size, checksum)}`` of the files, ``None`` for a missing one; largest files first, in parallel.
    ``algorithms`` gives a file's algorithm when it is not `ALGORITHM`, ``limits`` its recorded size (reading stops
    just past it)."""

    def one(rel: str) -> tuple[int, int] | None:
        try:
            return _crc_file(step_dir / rel, pace, (algorithms or {}).get(rel, ALGORITHM), (limits or {}).get(rel))
        except FileNotFoundError:
            return None

    n = min(threads or default_threads(), max(1, len(rels)))
    if n == 1:
        return {rel: one(rel) for rel in rels}
    sizes = {}
    for rel in rels:
        try:
            sizes[rel] = (step_dir / rel).stat().length
        except (FileNotFoundError, OSError):
            sizes[rel] = 0
    order = sorted(rels, key=lambda r: -sizes[r])
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="openhosti-crc") as pool:
        return dict(zip(order, pool.map(one, order), strict=True))


def _files_under(root: epath.Path, rel: str) -> list[str]:
    """Every file under ``root``; a symbolic link is listed, never followed (verification then reports it)."""
    out = []
    for child in root.iterdir():
        name = f"{rel}/{child.name}"
        local = "://" not in os.fspath(child)
        link = local and os.path.islink(os.fspath(child))
        out += _files_under(child, name) if child.is_dir() and not link else [name]
    return out


def item_files(step_dir: str | os.PathLike[str]) -> list[str]:
    """Every file of the step's Orbax items (``state``, ``data``, ``meta``), relative, sorted."""
    step_dir = epath.Path(step_dir)
    files = []
    for item in _ITEMS:
        if (step_dir / item).exists():
            files += _files_under(step_dir / item, item)
    return sorted(files)


def owner(rel: str) -> str:
    """The array a checkpoint file belongs to (``state/<name>/...``), else the file itself."""
    parts = rel.split("/")
    if parts[0] == "state" and len(parts) > 2 and parts[1] != "array_metadatas":
        return f"array {parts[1]!r}"
    return f"file {rel!r}"


# -- which chunk files hold which part of an array ---------------------------------------------------------


@dataclass(frozen=True)
class ChunkGrid:
    """The zarr chunk grid Orbax wrote an array with (``state/<name>/.zarray``)."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    separator: str = "."

    def key(self, index: tuple[int, ...]) -> str:
        """The chunk file name of chunk-grid ``index`` (``"0"`` for a scalar)."""
        return self.separator.join(str(i) for i in index) or "0"

    def parse(self, key: str) -> tuple[int, ...] | None:
        """The chunk-grid index of a chunk file name, ``None`` if it is not one."""
        if not self.shape:
            return () if key == "0" else None
        parts = key.split(self.separator)
        if len(parts) != len(self.shape) or not all(p.isdigit() for p in parts):
            return None
        return tuple(int(p) for p in parts)

    def overlapping(self, box: Box) -> Iterator[tuple[int, ...]]:
        """The chunk-grid indices that overlap ``box`` (``((start, stop), ...)`` per dimension), C order."""
        if any(stop <= start for start, stop in box):
            return iter(())
        ranges = [range(start // c, (stop - 1) // c + 1) for (start, stop), c in zip(box, self.chunks, strict=True)]
        return itertools.product(*ranges)


def read_grid(step_dir: str | os.PathLike[str], name: str) -> ChunkGrid | None:
    """The chunk grid of the saved array ``name``, ``None`` if its ``.zarray`` is missing or not zarr v2."""
    rel = f"state/{name}/.zarray"
    if path_problem(rel) is not None or file_problem(step_dir, rel) is not None:
        return None
    try:
        if (epath.Path(step_dir) / rel).stat().length > _MAX_RECORD:
            return None
        meta = json.loads((epath.Path(step_dir) / rel).read_text())
        shape, chunks, sep = tuple(meta["shape"]), tuple(meta["chunks"]), meta.get("dimension_separator") or "."
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in shape + chunks)
    if not ints or len(shape) != len(chunks) or min(shape, default=0) < 0 or min(chunks, default=1) < 1:
        return None  # a .zarray no Orbax wrote: its files are read (and checked) whole
    return ChunkGrid(shape, chunks, sep if sep in (".", "/") else ".")


def _box(index: tuple[Any, ...], shape: tuple[int, ...]) -> Box:
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape, strict=True))


def device_boxes(shape: tuple[int, ...], sharding: Any) -> list[tuple[Any, Box]]:
    """``[(device, the box of the array it holds)]`` in the sharding's device order."""
    return [(d, _box(idx, tuple(shape))) for d, idx in sharding.devices_indices_map(tuple(shape)).items()]


def chunk_writers(
    shape: tuple[int, ...], sharding: Any, grid: ChunkGrid, process_of: Callable[[Any], int] | None = None
) -> dict[str, int]:
    """``{chunk file name: process that writes it}`` for an array saved with ``sharding`` on ``grid``.

    Replica ``r`` of a shard (as `jax` numbers replicas) writes the ``r``-th chunk of the shard's box; the
    first writer found keeps a chunk. ``process_of(device)`` defaults to ``device.process_index``.
    """
    process_of = process_of or (lambda d: int(d.process_index))
    replica: Counter[Box] = Counter()
    writers: dict[str, int] = {}
    for device, box in device_boxes(shape, sharding):
        r = replica[box]
        replica[box] += 1
        pieces = list(grid.overlapping(box))
        if r < len(pieces):
            writers.setdefault(grid.key(pieces[r]), process_of(device))
    return writers


def files_written_by(
    step_dir: str | os.PathLike[str],
    arrays: dict[str, tuple[tuple[int, ...], Any]],
    process: int,
    files: list[str] | None = None,
    process_of: Callable[[Any], int] | None = None,
) -> list[str]:
    """The item files of a committed step that ``process`` wrote (process 0 also gets the unplaced ones).

    ``arrays`` is ``{name: (shape, sharding)}`` of the saved `jax.Array` leaves; ``files`` the step's
    `item_files` (listed here if ``None``).
    """
    step_dir = epath.Path(step_dir)
    files = item_files(step_dir) if files is None else files
    writer: dict[str, int] = {}
    for name, (shape, sharding) in arrays.items():
        grid = read_grid(step_dir, name)
        if grid is None or grid.shape != tuple(shape):
            continue
        for key, p in chunk_writers(tuple(shape), sharding, grid, process_of).items():
            writer[f"state/{name}/{key}"] = p
    for rel in files:
        m = _PROCESS_FILE_RE.match(rel)
        if m:
            writer[rel] = int(m.group(1))
    return [rel for rel in files if writer.get(rel, 0) == process]


def files_read_by(
    step_dir: str | os.PathLike[str], targets: dict[str, tuple[tuple[int, ...], Any]], candidates: Iterable[str]
) -> list[str]:
    """Which of ``candidates`` (relative item files) this process reads to restore ``targets``.

    ``targets`` is ``{name: (shape, sharding)}``: a chunk is read when it overlaps the box of an addressable
    device; chunks of arrays not in ``targets`` are not read; every other file (metadata) is.
    """
    import jax

    step_dir = epath.Path(step_dir)
    me = jax.process_index()
    wanted: dict[str, set[str] | None] = {}
    grids: dict[str, ChunkGrid | None] = {}
    out = []
    for rel in sorted(set(candidates)):
        parts = rel.split("/")
        name = parts[1] if len(parts) == 3 and parts[0] == "state" else None
        if name is None or parts[2].startswith(".") or name == "array_metadatas":
            out.append(rel)
            continue
        if name not in grids:
            grids[name] = read_grid(step_dir, name)
        grid = grids[name]
        if grid is None or grid.parse(parts[2]) is None:
            out.append(rel)  # not a chunk we can place: read it to be safe
            continue
        if name not in targets:
            continue
        if name not in wanted:
            shape, sharding = targets[name]
            keys: set[str] | None = None  # None: every chunk (a shape mismatch is reported elsewhere)
            if tuple(shape) == grid.shape:
                keys = set()
                for device, box in device_boxes(tuple(shape), sharding):
                    if device.process_index == me:
                        keys.update(grid.key(i) for i in grid.overlapping(box))
            wanted[name] = keys
        keys_of = wanted[name]
        if keys_of is None or parts[2] in keys_of:
            out.append(rel)
    return out


# -- recording and verifying -------------------------------------------------------------------------------


def record_checksums(
    step_dir: str | os.PathLike[str],
    files: list[str] | None = None,
    *,
    process: int = 0,
    process_count: int = 1,
    pace: Callable[[float], None] | None = None,
    threads: int | None = None,
    key: bytes | None = None,
) -> dict[str, list[int]]:
    """Checksum ``files`` (default: every item file) of a committed step; write and return this process's record
    (signed with ``key``: `openhosti_jax.checkpoint.trust.sign_record`).

    The record ``{relative path: [size, checksum]}`` (by `ALGORITHM`) goes to
    `record_name` ``(process, process_count)``, written
    atomically. ``pace(seconds)`` is called by each of the ``threads`` workers after each 4 MiB chunk with the
    time it took (a background caller sleeps there to leave the CPU to training).
    """
    step_dir = epath.Path(step_dir)
    rels = item_files(step_dir) if files is None else sorted(files)
    sums = _crc_many(step_dir, rels, threads, pace)
    gone = sorted(rel for rel, v in sums.items() if v is None)
    if gone:
        raise CheckpointError(
            f"expected every file of the committed step {step_dir} to stay while it is checksummed, found "
            f"{gone} deleted; the step is left without this process's record (not good): is another run "
            "writing to the same directory?"
        )
    record = {rel: list(v) for rel, v in sorted(sums.items()) if v is not None}
    name = record_name(process, process_count)
    tmp = step_dir / (name + ".tmp")
    body = {"version": 3, "algorithm": ALGORITHM, "process": process, "process_count": process_count, "files": record}
    tmp.write_text(json.dumps(sign_record(body, key)))
    tmp.replace(step_dir / name)
    return record


def load_records(step_dir: str | os.PathLike[str], key: bytes | None = None) -> tuple[dict[str, list[int]], list[str]]:
    """(The union of every process's record ``{rel: [size, checksum, algorithm]}``, problems reading them).

    Each record is checked before use (`openhosti_jax.checkpoint.trust.parse_record`: a malformed one, a path
    that leaves the step, an unknown algorithm, an HMAC that fails with ``key``): a problem names the record.
    """
    step_dir = epath.Path(step_dir)
    paths = record_files(step_dir)
    if not paths:
        return {}, [f"checksum records of {step_dir} are missing"]
    merged: dict[str, list[int]] = {}
    problems = []
    for path in sorted(paths, key=lambda p: p.name):
        why = file_problem(step_dir, path.name)
        try:
            if why is None and path.stat().length > _MAX_RECORD:
                why = f"is larger than {_MAX_RECORD} bytes"
            if why is None:
                entries, why = parse_record(json.loads(path.read_text()), key)
                merged.update(entries)
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
            why = f"is unreadable ({type(e).__name__}: {str(e)[:200]})"
        if why is not None:
            problems.append(f"checksum record {path} {why}")
    if not problems and not (has_checksums(step_dir) or locally_complete(step_dir)):
        problems.append(f"checksum records of {step_dir} are incomplete: {sorted(p.name for p in paths)}")
    return merged, problems


def verify_checksums(
    step_dir: str | os.PathLike[str],
    files: Iterable[str] | None = None,
    *,
    record: dict[str, list[int]] | None = None,
    threads: int | None = None,
) -> list[str]:
    """Every problem found (empty: the files match their record), each naming its array or file.

    ``files`` (relative paths) limits the check to what a process reads; ``None`` checks every recorded file
    and reports item files no record lists. ``record`` is `load_records`'s union (read here if ``None``).
    """
    step_dir = epath.Path(step_dir)
    if record is None:
        record, problems = load_records(step_dir)
        if problems:
            return problems
    on_disk = None
    if files is None:
        on_disk = item_files(step_dir)
        files = sorted(set(record) | set(on_disk))
    rels = sorted(set(files))
    problems, unsafe = _unsafe(step_dir, rels)
    rels = [rel for rel in rels if rel not in unsafe]
    unknown = [rel for rel in rels if rel not in record]
    if on_disk is None and unknown:
        unknown = [rel for rel in unknown if (step_dir / rel).exists()]
    algorithms = {rel: entry[2] for rel, entry in record.items() if len(entry) > 2}
    limits = {rel: int(entry[0]) for rel, entry in record.items()}
    sums = _crc_many(step_dir, [rel for rel in rels if rel in record], threads, algorithms=algorithms, limits=limits)
    for rel, got in sorted(sums.items()):
        size, crc = record[rel][:2]
        if got is None:
            problems.append(f"{owner(rel)}: file {rel} is missing")
        elif got[0] != size:
            found = f"more than {size}" if got[0] > size else str(got[0])  # reading stops just past the size
            problems.append(f"{owner(rel)}: file {rel} has {found} bytes, {size} were written (truncated?)")
        elif got[1] != crc:
            name = algorithms.get(rel, "crc32")
            problems.append(f"{owner(rel)}: file {rel} has checksum {name} {got[1]:#010x} (recorded {crc:#010x})")
    problems += [f"{owner(rel)}: file {rel} was not part of the committed step" for rel in sorted(unknown)]
    return problems


def check_sizes(step_dir: str | os.PathLike[str], files: Iterable[str], record: dict[str, list[int]]) -> list[str]:
    """The problems a ``stat`` finds (missing, truncated or unrecorded files) without reading any file."""
    step_dir = epath.Path(step_dir)
    problems, unsafe = _unsafe(step_dir, sorted(set(files)))
    for rel in sorted(set(files) - unsafe):
        try:
            size = (step_dir / rel).stat().length
        except (FileNotFoundError, OSError):
            size = None
        if rel not in record:
            if size is not None:
                problems.append(f"{owner(rel)}: file {rel} was not part of the committed step")
        elif size is None:
            problems.append(f"{owner(rel)}: file {rel} is missing")
        elif size != record[rel][0]:
            problems.append(f"{owner(rel)}: file {rel} has {size} bytes, {record[rel][0]} were written (truncated?)")
    return problems


def _unsafe(step_dir: epath.Path, rels: list[str]) -> tuple[list[str], set[str]]:
    """(problems, the paths among ``rels`` that must not be read: not a safe relative path, a symbolic link on the
    way, outside the step, not a regular file); a missing file is left to the caller."""
    problems, bad = [], set()
    for rel in rels:
        why = path_problem(rel)
        if why is None:
            why = file_problem(step_dir, rel)
            why = None if why == "missing" else why
        if why is not None:
            problems.append(f"{owner(rel) if isinstance(rel, str) else 'a file'}: file {str(rel)[:200]!r} {why}")
            bad.add(rel)
    return problems, bad
