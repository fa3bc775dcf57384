"""`run_with_restarts`: re-run a crashing training command with bounded retries and exponential backoff.

The command is expected to resume from its checkpoint directory on start (``CheckpointManager.restore`` of
``latest_good_step()``). Each attempt sees ``OPENHOSTI_RESTART=<n>`` (0 on the first run) in its environment.
A SIGTERM / SIGINT to the supervisor is passed on to the running command, which is then not restarted. For runs
of weeks, ``reset_after_s`` forgives old failures: an attempt that ran that long before failing starts the count
of restarts and the backoff afresh, so only failures in quick succession can exhaust ``max_restarts``.

Example:
    >>> import sys
    >>> from openhosti_jax.checkpoint.restart import run_with_restarts
    >>> run_with_restarts([sys.executable, "-c", "pass"], max_restarts=2, backoff_s=0.0)
    0
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from openhosti_jax.errors import ConfigError

RESTART_ENV = "OPENHOSTI_RESTART"


def run_with_restarts(
    cmd: Sequence[str],
    max_restarts: int = 3,
    backoff_s: float = 5.0,
    *,
    backoff_factor: float = 2.0,
    max_backoff_s: float = 300.0,
    env: dict[str, str] | None = None,
    reset_after_s: float | None = None,
) -> int:
    """Run ``cmd`` until it exits 0, restarting it at most ``max_restarts`` times; return its last exit code.

    Waits ``backoff_s * backoff_factor**k`` (capped at ``max_backoff_s``) before restart ``k+1``. A command
    killed by a signal reports ``-signum``, as `subprocess` does. With ``reset_after_s``, an attempt that ran at
    least that many seconds resets ``k`` to 0 and the restarts used to none (``OPENHOSTI_RESTART`` keeps counting).
    """
    if not cmd or not all(isinstance(c, str) for c in cmd):
        raise ConfigError(f"expected cmd to be a non-empty list of str, found {cmd!r}")
    finite = all(isinstance(x, int | float) and math.isfinite(x) for x in (backoff_s, backoff_factor, max_backoff_s))
    if not finite or max_restarts < 0 or backoff_s < 0 or backoff_factor < 1 or max_backoff_s < 0:
        raise ConfigError(
            f"expected max_restarts >= 0 and finite backoff_s >= 0, backoff_factor >= 1, max_backoff_s >= 0; found "
            f"{max_restarts}, {backoff_s}, {backoff_factor}, {max_backoff_s}"
        )
    if reset_after_s is not None and reset_after_s <= 0:
        raise ConfigError(f"expected reset_after_s > 0 or None (never reset), found {reset_after_s}")
    stop: list[int] = []
    child: list[subprocess.Popen[Any]] = []

    def forward(signum: int, frame: Any) -> None:
        stop.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    handled = (signal.SIGTERM, signal.SIGINT)
    old = {}
    try:
        old = {s: signal.signal(s, forward) for s in handled}
    except ValueError:  # not the main thread: signals stay with the caller
        pass
    try:
        attempt, used = 0, 0  # attempts started; restarts counted against max_restarts
        while True:
            started = time.monotonic()
            child[:] = [subprocess.Popen(list(cmd), env={**(env or os.environ), RESTART_ENV: str(attempt)})]
            rc = child[0].wait()
            if rc == 0 or stop:
                return rc
            ran_s = time.monotonic() - started
            if reset_after_s is not None and ran_s >= reset_after_s:
                used = 0
            if used == max_restarts:
                return rc
            used += 1
            attempt += 1
            delay = min(max_backoff_s, backoff_s * backoff_factor ** (used - 1))
            print(
                f"openhosti: {cmd[0]} exited with {rc} after {ran_s:.0f}s; restart {used}/{max_restarts} "
                f"in {delay:.1f}s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(delay)
    finally:
        if child and child[0].poll() is None:  # the supervisor itself failed: leave no orphan behind
            child[0].kill()
            child[0].wait()
        for s, h in old.items():
            signal.signal(s, h)
