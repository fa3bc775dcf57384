"""Nothing read from outside is trusted: names, paths and checksum records checked before use, and optional HMACs.

Whoever can write to the checkpoint directory or the bucket can plant a folder, an object key or a checksum record.
So every name and path that comes from a directory listing, a bucket listing or a record passes through here first:

- `is_step_name`: a step folder is ASCII digits in canonical form (``"12"``; not ``"²"``, ``"012"`` or ``"-1"``).
- `path_problem`: a relative path inside a step is ``/``-separated parts, none empty, ``.`` or ``..``, no
  backslash or NUL, not absolute, at most `MAX_PATH` characters.
- `file_problem`: on disk, the path stays inside its step folder with no symbolic link on the way, and names a
  regular file (not ``/dev/zero``, not a FIFO).
- `parse_record`: a checksum record is a JSON object whose ``files`` maps item files (``state/``, ``data/``,
  ``meta/``) to ``[size, checksum]`` (ints in range) with a known ``algorithm``; anything else is a problem.
- With a key (``OPENHOSTI_CHECKPOINT_KEY`` or ``CheckpointManager(key=...)``) records carry an HMAC-SHA256 of
  their content (`sign_record`), and a record whose HMAC does not match is a problem. Without one, the CRCs catch
  accidents (a flipped bit, a truncated file), not tampering: anyone who can rewrite a file can rewrite its CRC.

A problem marks the step corrupt: restore falls back to the newest intact step, with a warning naming the key.

Example:
    >>> from openhosti_jax.checkpoint.trust import is_step_name, parse_record, path_problem, sign_record
    >>> is_step_name("12"), is_step_name("²"), is_step_name("012")
    (True, False, False)
    >>> path_problem("state/w/0") is None, path_problem("meta/../../dev/zero")
    (True, "has a '..' part")
    >>> body = sign_record({"algorithm": "crc32", "files": {"state/w/0": [3, 7]}}, b"k")
    >>> parse_record(body, b"k")[0], parse_record(body, b"other")[1]
    ({'state/w/0': [3, 7, 'crc32']}, 'its HMAC-SHA256 does not match (tampered, or signed with another key)')
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from typing import Any

from openhosti_jax.errors import ConfigError

KEY_ENV = "OPENHOSTI_CHECKPOINT_KEY"
"""The environment variable that holds the HMAC key of checksum records (any non-empty string)."""
ALGORITHMS = ("crc32", "crc32c")
ITEMS = ("state", "data", "meta")
MAX_PATH = 4096
_STEP = re.compile(r"(0|[1-9][0-9]{0,17})\Z")
_MAX_SIZE = 1 << 50  # a petabyte: no checkpoint file is larger


def is_step_name(name: object) -> bool:
    """Whether ``name`` is a step folder's: ASCII digits, canonical (``str(int(name)) == name``), below 10**18."""
    return isinstance(name, str) and _STEP.match(name) is not None


def path_problem(rel: object) -> str | None:
    """None if ``rel`` is a safe relative path inside a step, else why not."""
    if not isinstance(rel, str) or not rel:
        return f"is not a non-empty string (found {type(rel).__name__})"
    if len(rel) > MAX_PATH:
        return f"is {len(rel)} characters long (at most {MAX_PATH})"
    if "\\" in rel or "\x00" in rel:
        return "holds a backslash or NUL"
    if rel.startswith("/"):
        return "is absolute"
    parts = rel.split("/")
    if ".." in parts:
        return "has a '..' part"
    if any(p in ("", ".") for p in parts):
        return "has an empty or '.' part"
    return None


def file_problem(step_dir: str | os.PathLike[str], rel: str) -> str | None:
    """None if ``step_dir/rel`` is a regular file reached without leaving ``step_dir`` or passing a symbolic link
    (``rel`` already passed `path_problem`); "missing" if nothing is there; else why it cannot be read. Paths off
    this machine (``gs://``) are left to their store."""
    root = os.fspath(step_dir)
    if "://" in root:
        return None
    path = root
    for i, part in enumerate(rel.split("/")):
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            return f"cannot be examined ({e})"
        if stat.S_ISLNK(mode):
            return "is (or passes through) a symbolic link"
        last = i == rel.count("/")
        if last and not stat.S_ISREG(mode):
            return "is not a regular file"
        if not last and not stat.S_ISDIR(mode):
            return "passes through something that is not a folder"
    real = os.path.realpath(path)
    if os.path.commonpath([real, os.path.realpath(root)]) != os.path.realpath(root):
        return "resolves outside its step"
    return None


def checkpoint_key(key: str | bytes | None = None) -> bytes | None:
    """The HMAC key: ``key`` if given, else ``$OPENHOSTI_CHECKPOINT_KEY``, else None (no HMAC)."""
    if key is None:
        key = os.environ.get(KEY_ENV) or None
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, bytes) or not key:
        raise ConfigError(f"expected the checkpoint key to be a non-empty str or bytes (or ${KEY_ENV}), found {key!r}")
    return key


def _digest(body: dict[str, Any], key: bytes) -> str:
    content = {k: v for k, v in body.items() if k != "hmac"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign_record(body: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """``body`` with its ``hmac`` (HMAC-SHA256 of the rest, canonical JSON) when there is a key."""
    body = {k: v for k, v in body.items() if k != "hmac"}
    if key is not None:
        body["hmac"] = _digest(body, key)
    return body


def _int(x: object, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def parse_record(body: object, key: bytes | None = None) -> tuple[dict[str, list[Any]], str | None]:
    """(``{rel: [size, checksum, algorithm]}``, None) of a record's parsed JSON, or ({}, what is wrong with it)."""
    if not isinstance(body, dict):
        return {}, f"is a JSON {type(body).__name__}, not an object"
    if key is not None:
        found = body.get("hmac")
        if not isinstance(found, str):
            return {}, "has no HMAC-SHA256, though a checkpoint key is set (written without the key?)"
        if not hmac.compare_digest(found, _digest(body, key)):
            return {}, "its HMAC-SHA256 does not match (tampered, or signed with another key)"
    algorithm = body.get("algorithm", "crc32")  # records before version 3 are zlib's CRC-32
    if algorithm not in ALGORITHMS:
        return {}, f"names the checksum algorithm {str(algorithm)[:40]!r}, expected one of {ALGORITHMS}"
    files = body.get("files")
    if not isinstance(files, dict):
        return {}, "has no 'files' object listing the step's files"
    out: dict[str, list[Any]] = {}
    for rel, entry in files.items():
        why = path_problem(rel)
        if why is None and rel.split("/", 1)[0] not in ITEMS:
            why = f"is not a file of the items {ITEMS}"
        if why is not None:
            return {}, f"lists the file {str(rel)[:200]!r}, which {why}"
        if not (isinstance(entry, list) and len(entry) == 2 and _int(entry[0], 0, _MAX_SIZE)):
            return {}, f"gives {rel!r} the entry {str(entry)[:80]}, expected [size, checksum] (two ints >= 0)"
        if not _int(entry[1], 0, 2**32 - 1):
            return {}, f"gives {rel!r} the checksum {str(entry[1])[:40]}, expected a 32-bit unsigned int"
        out[rel] = [entry[0], entry[1], algorithm]
    return out, None
