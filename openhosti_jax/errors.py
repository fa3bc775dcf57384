"""Typed errors. Each is also the built-in a caller would naturally catch (ValueError, RuntimeError, ...).

Messages say what was expected, what was found, where (a pytree path when there is one) and how to fix it.

Example:
    >>> from openhosti_jax.errors import MeshConfigError
    >>> try:
    ...     raise MeshConfigError("expected data*fsdp == 8, found 3; set data=-1 to infer it")
    ... except ValueError as e:
    ...     print(type(e).__name__)
    MeshConfigError
"""

from __future__ import annotations


class OpenhostiError(Exception):
    """Base class of every error raised on purpose by openhosti_jax."""


class ConfigError(OpenhostiError, ValueError):
    """A model or option configuration is invalid: a field out of range, an unknown name, a missing companion
    option. Argument checks raise it (or a more specific ValueError/TypeError subclass), never a RuntimeError."""


class MeshConfigError(OpenhostiError, ValueError):
    """A mesh configuration does not match the devices (sizes, axes, multi-host layout)."""


class ShardingError(OpenhostiError, ValueError):
    """A sharding spec, logical-axis rule or plan does not fit a leaf's shape or the mesh."""


class PlanningError(OpenhostiError, ValueError):
    """The planner found no candidate that satisfies the constraints (memory budget, divisibility)."""


class MemoryBudgetError(PlanningError):
    """Nothing fits the memory budget; the message gives the smallest requirement found."""


class BatchError(OpenhostiError, ValueError):
    """A batch's shape or sharding does not fit the mesh or the microbatch configuration."""


class PipelineError(OpenhostiError, ValueError):
    """A pipeline request cannot be met (more stages than layers, a memory cap no cut satisfies, ...)."""


class BalanceError(OpenhostiError, ValueError):
    """A load-balancing assignment or measurement is invalid."""


class CheckpointError(OpenhostiError, RuntimeError):
    """A checkpoint could not be saved, found or restored."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written: ``step`` (None: found before the first save, at construction) and
    ``path`` say which and where; the message gives the cause (the OS's errno text) and the fix."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.path = path

    def __reduce__(self) -> tuple:  # pickles (e.g. across processes) with its step and path
        return (_save_error, (str(self), self.step, self.path))


def _save_error(message: str, step: int | None, path: str | None) -> CheckpointSaveError:
    return CheckpointSaveError(message, step=step, path=path)


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's stored bytes do not match the checksums written at save time."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's leaves (names, shapes, dtypes) differ from the state being restored; nothing is corrupt."""


class DistributedError(OpenhostiError, RuntimeError):
    """Multi-process initialisation, barrier or collective failed or timed out."""


class BridgeError(OpenhostiError, TypeError):
    """A tensor or model cannot be converted between JAX and PyTorch / TensorFlow."""


class UnsupportedError(OpenhostiError, NotImplementedError):
    """An API of another framework (``tf.distribute``'s ``run``, ``reduce``, ...) that has no equivalent here; the
    message names what to use instead."""


class StateError(OpenhostiError, ValueError):
    """A TrainState or model init function is not what the library expected."""


class StepArgumentError(OpenhostiError, TypeError):
    """A train step's argument is neither a pytree of arrays nor an nnx graph object, or a static one is unhashable."""


class NonFiniteError(StateError):
    """Training made no progress: every update of too many steps in a row was not finite (skipped); the message
    names the step and the last finite loss."""


class StepOutputError(StateError):
    """A ``step(state, batch)`` returned something other than ``(new_state, metrics)``."""


class ReportError(OpenhostiError, FileNotFoundError):
    """A run directory or its metrics file, needed for a report, is missing or unreadable."""


class MissingDataError(OpenhostiError, LookupError):
    """A report's figure needs values the run did not record (a metric, a field of the plan)."""


class UsageError(ConfigError):
    """The ``openhosti`` command was given arguments it cannot run (the message says which and the fix)."""


__all__ = [
    "OpenhostiError",
    "ConfigError",
    "MeshConfigError",
    "ShardingError",
    "PlanningError",
    "MemoryBudgetError",
    "BatchError",
    "PipelineError",
    "BalanceError",
    "CheckpointError",
    "CheckpointSaveError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "DistributedError",
    "BridgeError",
    "UnsupportedError",
    "StateError",
    "NonFiniteError",
    "StepArgumentError",
    "StepOutputError",
    "ReportError",
    "MissingDataError",
    "UsageError",
]


class MissingExtraError(UnsupportedError):
    """An optional extra the call needs is not installed (libtpu for a TPU target, a framework for its door); the
    message names the ``pip install`` that adds it."""


class CompileError(OpenhostiError, RuntimeError):
    """The compiler rejected a program for a reason other than memory: the message keeps the compiler's own words
    and names the plan (candidate) it was compiling."""
