"""Per-array checksums of a committed checkpoint step, and their verification.

Orbax restores a file with a flipped byte without complaint. After a step is committed, every file of its
items is read back and recorded as ``[size, crc32]`` in ``<step>/openhosti_checksums.json`` (written last,
atomically, so a step without it was never verified). Files under ``state/<name>/`` belong to the array
``<name>``: a flipped byte (CRC-32 catches every error burst up to 32 bits), a truncated file (size) or a
deleted file (missing) is reported under that array's name.

Example:
    >>> import pathlib, tempfile
    >>> from openhosti_jax.checkpoint.checksums import record_checksums, verify_checksums
    >>> step = pathlib.Path(tempfile.mkdtemp())
    >>> (step / "state" / "w").mkdir(parents=True); _ = (step / "state" / "w" / "0").write_bytes(b"abc")
    >>> _ = record_checksums(step); verify_checksums(step)
    []
    >>> _ = (step / "state" / "w" / "0").write_bytes(b"abd"); verify_checksums(step)
    ["array 'w': file state/w/0 has crc32 ... (recorded ...)"]
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

from etils import epath

CHECKSUM_FILE = "openhosti_checksums.json"
_ITEMS = ("state", "data", "meta")
_CHUNK = 4 << 20


def _crc_file(path: epath.Path, pace: Callable[[float], None] | None = None) -> tuple[int, int]:
    crc, size = 0, 0
    with path.open("rb") as f:
        while True:
            t0 = time.perf_counter()
            chunk = f.read(_CHUNK)
            if not chunk:
                return size, crc
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            if pace is not None:
                pace(time.perf_counter() - t0)


def _files_under(root: epath.Path, rel: str) -> list[str]:
    out = []
    for child in root.iterdir():
        name = f"{rel}/{child.name}"
        out += _files_under(child, name) if child.is_dir() else [name]
    return out


def _item_files(step_dir: epath.Path) -> list[str]:
    files = []
    for item in _ITEMS:
        if (step_dir / item).exists():
            files += _files_under(step_dir / item, item)
    return sorted(files)


def owner(rel: str) -> str:
    """The array a checkpoint file belongs to (``state/<name>/...``), else the file itself."""
    parts = rel.split("/")
    if parts[0] == "state" and len(parts) > 2:
        return f"array {parts[1]!r}"
    return f"file {rel!r}"


def record_checksums(
    step_dir: str | os.PathLike[str], pace: Callable[[float], None] | None = None
) -> dict[str, list[int]]:
    """Checksum every item file of a committed step; write and return ``{relative path: [size, crc32]}``.

    ``pace(seconds)`` is called after each 4 MiB chunk with the time it took (a background caller sleeps there
    to leave the CPU to training).
    """
    step_dir = epath.Path(step_dir)
    record = {rel: list(_crc_file(step_dir / rel, pace)) for rel in _item_files(step_dir)}
    tmp = step_dir / (CHECKSUM_FILE + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "files": record}))
    tmp.rename(step_dir / CHECKSUM_FILE)
    return record


def has_checksums(step_dir: str | os.PathLike[str]) -> bool:
    """Whether the step's checksum record was written (the step finished committing and was checksummed)."""
    return (epath.Path(step_dir) / CHECKSUM_FILE).exists()


def verify_checksums(step_dir: str | os.PathLike[str]) -> list[str]:
    """Every problem found (empty: the step's files match their record), each naming its array or file."""
    step_dir = epath.Path(step_dir)
    try:
        record: dict[str, Any] = json.loads((step_dir / CHECKSUM_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return [f"checksum record {step_dir / CHECKSUM_FILE} is missing or unreadable ({e})"]
    problems = []
    for rel, (size, crc) in sorted(record.items()):
        path = step_dir / rel
        if not path.exists():
            problems.append(f"{owner(rel)}: file {rel} is missing")
            continue
        got_size, got_crc = _crc_file(path)
        if got_size != size:
            problems.append(f"{owner(rel)}: file {rel} has {got_size} bytes, {size} were written (truncated?)")
        elif got_crc != crc:
            problems.append(f"{owner(rel)}: file {rel} has crc32 {got_crc:#010x} (recorded {crc:#010x})")
    extra = sorted(set(_item_files(step_dir)) - set(record))
    problems += [f"{owner(rel)}: file {rel} was not part of the committed step" for rel in extra]
    return problems
