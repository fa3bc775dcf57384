"""A measured `DeviceProfile` kept on disk per machine and backend, so that a second run plans without measuring.

A calibration takes seconds (6 s for 8 simulated CPU devices on a 2-core machine) and every door plans by default,
so each measured profile is written to ``<cache dir>/profiles/<key>.json``. The key (`profile_key`) hashes what the
measurement depends on: the host name, the backend and device kind, the device counts (all, local, processes), the
CPU count, the jax and jaxlib versions and the calibrated sizes. A file that does not parse or describes another key
is ignored and measured again (and overwritten); ``OPENHOSTI_RECALIBRATE=1`` (or ``recalibrate=True``) measures
again regardless. The cache directory is ``$OPENHOSTI_CACHE_DIR``, else ``$XDG_CACHE_HOME/openhosti_jax``, else
``~/.cache/openhosti_jax``.

Example:
    >>> import tempfile
    >>> from openhosti_jax.planner.profiles import PROFILES
    >>> with tempfile.TemporaryDirectory() as d:
    ...     store(PROFILES["A100"], "k1", d).name, load("k1", d) == PROFILES["A100"], load("k2", d)
    ('k1.json', True, None)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from openhosti_jax.planner.profiles import CompilerMemory, DeviceProfile

FORMAT = 2
"""Version of the file layout; a file of another version is measured again (2: profiles carry the compiler's
memory record, `CompilerMemory`)."""


def cache_dir() -> Path:
    """Where measured profiles are kept: ``$OPENHOSTI_CACHE_DIR``, ``$XDG_CACHE_HOME/openhosti_jax`` or
    ``~/.cache/openhosti_jax``."""
    if os.environ.get("OPENHOSTI_CACHE_DIR"):
        return Path(os.environ["OPENHOSTI_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "openhosti_jax"


def recalibrate_requested() -> bool:
    """Whether ``OPENHOSTI_RECALIBRATE`` asks for a new measurement (any value but ``""``/``"0"``)."""
    return os.environ.get("OPENHOSTI_RECALIBRATE", "") not in ("", "0")


def profile_key(devices: Sequence[jax.Device], sizes: Sequence[int]) -> str:
    """A short hash of what a calibration of ``devices`` at ``sizes`` depends on on this machine."""
    import jaxlib

    facts = {
        "format": FORMAT,
        "host": socket.gethostname(),
        "platform": devices[0].platform,
        "kind": devices[0].device_kind,
        "devices": len(devices),
        "local": sum(d.process_index == jax.process_index() for d in devices),
        "processes": jax.process_count(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "sizes": sorted(int(s) for s in sizes),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def _encode(profile: DeviceProfile) -> dict[str, Any]:
    fields = dataclasses.asdict(profile)
    fields["link_curve"] = {k: {str(n): pts for n, pts in g.items()} for k, g in profile.link_curve.items()}
    return fields


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _decode(fields: dict[str, Any]) -> DeviceProfile:
    known = {f.name for f in dataclasses.fields(DeviceProfile)}
    values = {k: v for k, v in fields.items() if k in known}
    values["link_curve"] = {
        kind: {int(n): _tuples(pts) for n, pts in groups.items()} for kind, groups in values["link_curve"].items()
    }
    if isinstance(values.get("memory"), dict):  # the compiler's memory record, stored as its fields
        values["memory"] = CompilerMemory(**values["memory"])
    return DeviceProfile(**{k: _tuples(v) if k not in ("link_curve", "memory") else v for k, v in values.items()})


def digest(profile: DeviceProfile) -> str:
    """A hash of every field of ``profile`` (processes compare it before trusting their cached copies)."""
    return hashlib.sha256(json.dumps(_encode(profile), sort_keys=True).encode()).hexdigest()[:20]


def load(key: str, directory: str | os.PathLike[str] | None = None) -> DeviceProfile | None:
    """The profile stored under ``key``, or None when there is none or it cannot be read as one."""
    path = Path(directory or cache_dir()) / "profiles" / f"{key}.json"
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT or record.get("key") != key:
            return None
        return _decode(record["profile"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent, truncated, or from another version: measure again


def store(profile: DeviceProfile, key: str, directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Write ``profile`` under ``key`` atomically (a reader never sees half a file); the path, or None when the
    directory cannot be written (the profile is then measured again next run)."""
    folder = Path(directory or cache_dir()) / "profiles"
    record = {"format": FORMAT, "key": key, "profile": _encode(profile)}
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return None
    return folder / f"{key}.json"
