"""Copy committed checkpoint steps to a second location (any `etils.epath` path: a local folder, ``gs://``,
``s3://`` with its fsspec package installed).

Object stores have no atomic rename (a rename is a copy and a delete), so a replica step is committed by what is
copied last: the step's checksum records. A step counts as complete only when every process's record is there
(`openhosti_jax.checkpoint.checksums.has_checksums`), so a reader never takes a half-copied step for a good one:
one cut short (a kill mid-upload, a lost connection) is skipped and removed by the next copy. The data files are
copied ``threads`` at a time; the checksums travel with them and are verified when the step is restored. Steps
beyond ``keep`` are pruned, and so are incomplete ones older than the newest complete step.

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

import os
from concurrent.futures import ThreadPoolExecutor

from etils import epath

from openhosti_jax.checkpoint.checksums import has_checksums, record_files


def _files(root: epath.Path) -> list[epath.Path]:
    """Every file under ``root``, as paths relative to it."""
    out: list[epath.Path] = []
    for child in root.iterdir():
        out += [child.name / f for f in _files(child)] if child.is_dir() else [epath.Path(child.name)]
    return out


def replica_steps(dest: str | os.PathLike[str]) -> list[int]:
    """The complete steps under ``dest`` (every process's checksum record copied), ascending."""
    dest = epath.Path(dest)
    if not dest.exists():
        return []
    return sorted(int(p.name) for p in dest.iterdir() if p.name.isdigit() and p.is_dir() and has_checksums(p))


def replicate_step(
    step_dir: str | os.PathLike[str], dest: str | os.PathLike[str], *, keep: int | None, threads: int = 8
) -> None:
    """Copy ``step_dir`` to ``dest/<its name>``, data files first (``threads`` at a time) and its checksum
    records last (the commit), then keep only the newest ``keep`` complete steps there."""
    step_dir, dest = epath.Path(step_dir), epath.Path(dest)
    final = dest / step_dir.name
    if final.exists():  # an earlier copy cut short (or a stale one): start again
        final.rmtree()
    records = {p.name for p in record_files(step_dir)}
    files = _files(step_dir)
    data = [f for f in files if str(f) not in records]

    def copy(rel: epath.Path) -> None:
        (final / rel).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / rel).copy(final / rel, overwrite=True)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(copy, data))
    for name in sorted(records):  # the commit: with every record present the step counts as complete
        copy(epath.Path(name))
    prune(dest, keep)


def prune(dest: str | os.PathLike[str], keep: int | None) -> None:
    """Remove complete steps beyond the newest ``keep`` and incomplete ones older than the newest complete step."""
    dest = epath.Path(dest)
    complete = replica_steps(dest)
    if not complete:
        return
    drop = set(complete[:-keep] if keep else [])
    drop |= {int(p.name) for p in dest.iterdir() if p.name.isdigit() and int(p.name) < complete[-1]} - set(complete)
    for step in sorted(drop):
        (dest / str(step)).rmtree()
