"""Barriers and agreement between processes, with a timeout that names the process that did not arrive, instead of
hanging: the one way processes agree.

All work through the key-value store of the `jax.distributed` coordinator: each process writes its key, then
waits until every process's key is there. On timeout the error lists the missing process ids. (The coordinator's
``get_live_nodes`` is not used: it is itself a blocking rendezvous of the listed processes.) `gathered` hands every
process all the values, from which each caller takes what it needs (process 0's choice, everyone's findings
merged); `agree` demands they are equal. With a single process all are no-ops. Every process must make the same
sequence of calls with the same names.

Example:
    >>> from openhosti_jax.mesh.barrier import barrier, agree
    >>> barrier("after-init", timeout_s=30)  # one process: returns at once
    >>> agree("plan", "fsdp 1x8")
    'fsdp 1x8'
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from typing import Any

import jax

from openhosti_jax.errors import ConfigError, DistributedError

_PREFIX = "openhosti"
_calls: defaultdict[str, itertools.count] = defaultdict(itertools.count)
_POLL_S = 0.02


def _client() -> Any | None:
    from jax._src import distributed  # the coordinator's key-value client; no public accessor in jax 0.10

    return distributed.global_state.client


def _gather(kind: str, name: str, value: str, timeout_s: float) -> list[str] | None:
    """Every process's ``value`` (by process id), or None on a single process; raises naming the missing ones."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"{kind} name must be a non-empty string without '/', found {name!r}")
    if not timeout_s > 0:
        raise ConfigError(f"{kind} timeout_s must be > 0, found {timeout_s!r}")
    client = _client() if jax.process_count() > 1 else None
    if client is None:
        return None
    n, me = jax.process_count(), jax.process_index()
    directory = f"{_PREFIX}/{kind}/{name}/{next(_calls[f'{kind}/{name}'])}/"
    client.key_value_set(directory + str(me), value)
    deadline = time.monotonic() + timeout_s
    while True:
        found = _entries(kind, name, directory, client.key_value_dir_get(directory), n)
        if len(found) == n:
            return [found[i] for i in range(n)]
        if time.monotonic() > deadline:
            missing = [i for i in range(n) if i not in found]
            state = ", ".join(f"process {i}" for i in missing)
            raise DistributedError(
                f"{kind} {name!r}: process {me} waited {timeout_s:g}s but {len(missing)} of {n} processes never "
                f"arrived: {state}. Expected every process to reach the same {kind}; check the missing processes' "
                "logs (a crash, a hang, or a code path that skips this call)"
            )
        time.sleep(_POLL_S)


def _entries(kind: str, name: str, directory: str, items: Any, n: int) -> dict[int, str]:
    """``{process id: value}`` of the key-value store's entries under ``directory``, each checked: the store is
    shared by every process of the job (and whoever else reaches the coordinator), so a key that is not
    ``<directory><id>`` for an id below ``n``, or a value that is not a string, is a `DistributedError` naming it."""
    found: dict[int, str] = {}
    for item in items:
        key, value = item if isinstance(item, tuple | list) and len(item) == 2 else (item, None)
        tail = key[len(directory) :] if isinstance(key, str) and key.startswith(directory) else None
        if tail is None or not tail.isascii() or not tail.isdigit() or int(tail) >= n or not isinstance(value, str):
            raise DistributedError(
                f"{kind} {name!r}: expected the key-value store's entries under {directory!r} to be one per process "
                f"id 0..{n - 1}, each a string, found the key {str(key)[:200]!r} with the value {repr(value)[:200]}; "
                "another job on the same coordinator, or someone who reached its port, wrote it"
            )
        found[int(tail)] = value
    return found


def barrier(name: str, *, timeout_s: float = 300.0) -> None:
    """Wait until every process has called ``barrier(name)``; `DistributedError` naming the absent ones on timeout.

    Example:
        >>> barrier("checkpoint-committed", timeout_s=60)
    """
    _gather("barrier", name, "1", timeout_s)


def gathered(name: str, value: Any, *, timeout_s: float = 300.0) -> list[Any]:
    """Every process's ``value`` (anything JSON carries: a digest, a few ints, a list of messages) in process
    order, as JSON gives it back (tuples as lists; one process: ``[value]``), for choices that need them all:
    every process takes process 0's choice as ``gathered(...)[0]``, or merges everyone's findings.

    Example:
        >>> gathered("cached-profile", "abc")
        ['abc']
        >>> size, peak = gathered("microbatch-choice", (6, 2**40))[0]  # process 0's, on every process
        >>> size, peak
        (6, 1099511627776)
    """
    text = json.dumps(value)
    values = _gather("gathered", name, text, timeout_s)
    if values is None:
        return [json.loads(text)]
    out = []
    for p, v in enumerate(values):
        try:
            out.append(json.loads(v))
        except ValueError as e:
            raise DistributedError(
                f"gathered {name!r}: expected process {p}'s value in the key-value store to be JSON, found "
                f"{v[:200]!r} ({e}); another job on the same coordinator, or someone who reached its port, wrote it"
            ) from e
    return out


def agree(name: str, value: str, *, timeout_s: float = 300.0) -> str:
    """Check that every process passes the same ``value`` (a plan, a config digest); return it.

    Raises `DistributedError` naming the processes that differ from process 0, or that never arrived.

    Example:
        >>> agree("mesh", "data=1 fsdp=8")
        'data=1 fsdp=8'
    """
    if not isinstance(value, str):
        raise ConfigError(f"agree {name!r}: value must be a str (e.g. a digest), found {type(value).__name__}")
    values = _gather("agree", name, value, timeout_s)
    if values is None:
        return value
    differ = [i for i, v in enumerate(values) if v != values[0]]
    if differ:
        shown = "; ".join(f"process {i}: {values[i][:200]!r}" for i in differ)
        raise DistributedError(
            f"agree {name!r}: expected every process to hold process 0's value {values[0][:200]!r}, found {shown}. "
            "Processes must compute this from the same config, seeds and library versions"
        )
    return value
