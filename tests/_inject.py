"""Faults injected into this process, for the checkpoint fault tests (not a test module).

The tests may run as root, where ``chmod`` stops no write, and no loopback or read-only mount is available, so:

- `read_only` makes every write under a directory fail with ``EROFS`` at the Python OS-call level (``io.open`` and
  ``os.open`` for writing, ``os.mkdir``, ``os.rename``, ``os.replace``, ``os.unlink``, ``os.rmdir``), as a read-only
  mount would; `disk_full` does the same with ``ENOSPC``, as a disk with no byte left (other disks, ``/tmp``, still
  take writes). Orbax's TensorStore writes are C++ and do not pass there, but the probe `CheckpointManager` makes
  before each save is refused first, as on a real read-only or full disk.
- `file_size_limit` sets ``RLIMIT_FSIZE``: the kernel itself refuses any write past that many bytes in a file
  (``EFBIG``, "File too large"), TensorStore's included: a disk that fills up in the middle of a save.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import resource
import signal
from collections.abc import Iterator

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def read_only(directory: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """Inside: writes under ``directory`` fail with ``OSError(EROFS)``."""
    return refused(directory, errno.EROFS)


def disk_full(directory: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """Inside: writes under ``directory`` fail with ``OSError(ENOSPC)``."""
    return refused(directory, errno.ENOSPC)


@contextlib.contextmanager
def refused(directory: str | os.PathLike[str], code: int) -> Iterator[None]:
    """Inside: writes under ``directory`` fail with ``OSError(code)``."""
    root = os.path.abspath(os.fspath(directory))

    def under(path: object) -> bool:
        try:
            p = os.path.abspath(os.fspath(path))
        except TypeError:
            return False
        return p == root or p.startswith(root + os.sep)

    def refuse(path: object) -> OSError:
        return OSError(code, os.strerror(code), os.fspath(path))

    real = {name: getattr(os, name) for name in ("open", "mkdir", "rename", "replace", "unlink", "remove", "rmdir")}
    real_io_open = io.open

    def io_open(file, mode="r", *args, **kwargs):
        if isinstance(mode, str) and any(c in mode for c in "wax+") and under(file):
            raise refuse(file)
        return real_io_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS and under(path):
            raise refuse(path)
        return real["open"](path, flags, *args, **kwargs)

    def one_path(name):
        def call(path, *args, **kwargs):
            if under(path):
                raise refuse(path)
            return real[name](path, *args, **kwargs)

        return call

    def two_paths(name):
        def call(src, dst, *args, **kwargs):
            if under(src) or under(dst):
                raise refuse(dst)
            return real[name](src, dst, *args, **kwargs)

        return call

    patched = {"open": os_open, "mkdir": one_path("mkdir"), "unlink": one_path("unlink")}
    patched |= {"remove": one_path("remove"), "rmdir": one_path("rmdir")}
    patched |= {"rename": two_paths("rename"), "replace": two_paths("replace")}
    import builtins

    real_builtin_open = builtins.open
    try:
        io.open = io_open
        builtins.open = io_open
        for name, fn in patched.items():
            setattr(os, name, fn)
        yield
    finally:
        io.open = real_io_open
        builtins.open = real_builtin_open
        for name, fn in real.items():
            setattr(os, name, fn)


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Inside: the kernel refuses writes past ``nbytes`` in any file of this process (``EFBIG``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
