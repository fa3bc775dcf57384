"""Copy committed checkpoint steps to a second location (any `etils.epath` path: a local folder, ``gs://``).

A step is copied into ``<dest>/<step>.partial`` and renamed to ``<dest>/<step>`` when complete, so a reader of
the replica never sees half a step; older steps beyond ``keep`` are removed.

Example:
    >>> import pathlib, tempfile
    >>> from openhosti_jax.checkpoint.replicate import replicate_step
    >>> src, dst = pathlib.Path(tempfile.mkdtemp()), pathlib.Path(tempfile.mkdtemp())
    >>> (src / "7" / "state").mkdir(parents=True); _ = (src / "7" / "state" / "a").write_text("x")
    >>> replicate_step(src / "7", dst, keep=2); sorted(p.name for p in dst.iterdir())
    ['7']
"""

from __future__ import annotations

import os

from etils import epath

_PARTIAL = ".partial"


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for child in src.iterdir():
        if child.is_dir():
            _copy_tree(child, dst / child.name)
        else:
            child.copy(dst / child.name, overwrite=True)


def replica_steps(dest: str | os.PathLike[str]) -> list[int]:
    """The complete steps present under ``dest``, ascending."""
    dest = epath.Path(dest)
    if not dest.exists():
        return []
    return sorted(int(p.name) for p in dest.iterdir() if p.name.isdigit() and p.is_dir())


def replicate_step(step_dir: str | os.PathLike[str], dest: str | os.PathLike[str], *, keep: int | None) -> None:
    """Copy ``step_dir`` to ``dest/<its name>`` atomically, then keep only the newest ``keep`` steps there."""
    step_dir, dest = epath.Path(step_dir), epath.Path(dest)
    final, partial = dest / step_dir.name, dest / (step_dir.name + _PARTIAL)
    if partial.exists():
        partial.rmtree()
    _copy_tree(step_dir, partial)
    if final.exists():
        final.rmtree()
    partial.rename(final)
    steps = replica_steps(dest)
    for old in steps[:-keep] if keep else []:
        (dest / str(old)).rmtree()
