"""A persistent compilation cache, on by default, so a second process (a restart, the next run of a job, another
host of the same job) loads its step's executable instead of compiling it again.

`enable_compile_cache` points jax's own cache (``jax_compilation_cache_dir``) at ``<cache dir>/xla/jax-<version>-
jaxlib-<version>`` under the library's cache directory (``$OPENHOSTI_CACHE_DIR``, else ``$XDG_CACHE_HOME/
openhosti_jax``, else ``~/.cache/openhosti_jax``; `openhosti_jax.planner.profile_cache.cache_dir`), made readable
by its owner only: jax warns that whoever can write to the cache can run code in the processes that read it. ``@spmd``
and `openhosti_jax.create_train_state` call it before they compile.

The key is jax's (jax 0.10.2, ``jax._src.cache_key``): a hash of the program's StableHLO (its shardings, hence the
mesh shape and axis names, included), the jaxlib version, the backend's platform and version, ``XLA_FLAGS``, the
compile options (the step's GPU settings, `openhosti_jax.policies.compiler`, and the device assignment, except on a
GPU, where it is stripped so every process of a job shares an entry) and the devices' topology. A change of any of
these misses and compiles; nothing stale is loaded. The versions in the directory's name keep one version's entries
apart from another's, so removing old directories removes exactly what no version reads any more.

Thresholds: jax writes a program only if it took ``jax_persistent_cache_min_compile_time_secs`` (1 s) to compile;
`caching_steps` lowers that to 0 for the library's own step and state initialisation, the programs a restart
compiles again (the rest of a process's small programs keep jax's threshold). The cache is bounded at
`DEFAULT_MAX_BYTES` (jax's default: unbounded), least recently used first, where ``filelock`` is installed (jax
needs it to evict). ``jax_persistent_cache_min_entry_size_bytes`` stays jax's (0: jax picks one for the
filesystem).

The user's settings win: a ``jax_compilation_cache_dir`` already set (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.update``) is kept, as is ``jax_enable_compilation_cache=False``; a min compile time or max size set in
the environment or away from jax's default is kept. ``OPENHOSTI_COMPILE_CACHE=0`` turns the library's cache off.

Example:
    >>> import os, tempfile
    >>> os.environ["OPENHOSTI_COMPILE_CACHE"] = "0"
    >>> enable_compile_cache().describe()
    'compile cache: off (OPENHOSTI_COMPILE_CACHE=0)'
    >>> del os.environ["OPENHOSTI_COMPILE_CACHE"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import jax
from jax._src import config as jax_config  # the thread-local threshold override (jax is pinned below 0.11)

from openhosti_jax.planner.profile_cache import cache_dir

DEFAULT_MAX_BYTES = 8 * 2**30
"""The library's bound on the cache's size (8 GiB), where jax can evict (``filelock`` installed)."""

JAX_MIN_COMPILE_SECONDS = 1.0
"""jax 0.10.2's default ``jax_persistent_cache_min_compile_time_secs``."""


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """Where the compilation cache is and who chose it."""

    directory: str | None
    """The cache directory jax writes to (None: no persistent cache)."""
    chosen_by: str
    """``"openhosti"`` (the library's default), ``"user"`` (jax's config was already set) or ``"off"``."""
    reason: str = ""
    """Why it is off, or what was left as the user set it."""

    def describe(self) -> str:
        """One line for a report."""
        if self.directory is None:
            return f"compile cache: off ({self.reason})"
        who = "the user's" if self.chosen_by == "user" else "the library's"
        return f"compile cache: {who} at {self.directory}" + (f" ({self.reason})" if self.reason else "")


def _off_by_env() -> bool:
    return os.environ.get("OPENHOSTI_COMPILE_CACHE", "1").strip().lower() in ("0", "false", "off", "no")


def cache_path() -> Path:
    """The library's cache directory for this jax and jaxlib."""
    import jaxlib

    return cache_dir() / "xla" / f"jax-{jax.__version__}-jaxlib-{jaxlib.__version__}"


def _filelock() -> bool:
    try:
        import filelock  # noqa: F401
    except ImportError:
        return False
    return True


def enable_compile_cache() -> CompileCache:
    """Point jax's persistent compilation cache at `cache_path` unless the user chose otherwise (see the module
    docstring); returns where it is. Safe to call again: the first decision stands while jax's config holds it."""
    if _off_by_env():
        return CompileCache(None, "off", "OPENHOSTI_COMPILE_CACHE=0")
    if not jax.config.jax_enable_compilation_cache:
        return CompileCache(None, "off", "jax_enable_compilation_cache=False")
    current = jax.config.jax_compilation_cache_dir
    if current is not None:
        mine = current == str(cache_path())
        return CompileCache(current, "openhosti" if mine else "user")
    path = cache_path()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path, 0o700)
    except OSError as err:
        return CompileCache(None, "off", f"cannot create {path}: {err}")
    bounded = ""
    if jax.config.jax_compilation_cache_max_size == -1 and "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        if _filelock():
            jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
            bounded = f"bounded at {DEFAULT_MAX_BYTES // 2**30} GiB"
        else:
            bounded = "unbounded: install filelock for jax to evict"
    jax.config.update("jax_compilation_cache_dir", str(path))
    return CompileCache(str(path), "openhosti", bounded)


def _users_threshold() -> bool:
    """Whether the user set the min compile time (its environment variable, or a value other than jax's)."""
    value = jax.config.jax_persistent_cache_min_compile_time_secs
    return "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" in os.environ or value != JAX_MIN_COMPILE_SECONDS


@contextlib.contextmanager
def caching_steps() -> Iterator[None]:
    """In this thread, every program compiled is written to the persistent cache however fast it compiled (where
    the cache is on and the user did not set the threshold): wrap the library's own step and init compiles."""
    if jax.config.jax_compilation_cache_dir is None or _users_threshold():
        yield
        return
    with jax_config.persistent_cache_min_compile_time_secs(0.0):
        yield


__all__ = ["CompileCache", "cache_path", "caching_steps", "enable_compile_cache"]
