"""Microbatching: gradient accumulation, memory probe, largest-fitting microbatch search, OOM retry."""

from openhosti_jax.microbatch.accumulate import (
    accumulate_gradients,
    batch_size_of,
    microbatch_layout,
    split_microbatches,
)
from openhosti_jax.microbatch.find import MicrobatchChoice, compile_bound, find_microbatch
from openhosti_jax.microbatch.probe import PeakFn, analytic_peak_bytes, compiled_peak_bytes, peak_bytes
from openhosti_jax.microbatch.retry import OOMRetryStep, halve_microbatch, is_resource_exhausted
from openhosti_jax.microbatch.train_step import make_train_step

__all__ = [
    "MicrobatchChoice",
    "OOMRetryStep",
    "PeakFn",
    "accumulate_gradients",
    "analytic_peak_bytes",
    "batch_size_of",
    "compile_bound",
    "compiled_peak_bytes",
    "find_microbatch",
    "halve_microbatch",
    "is_resource_exhausted",
    "make_train_step",
    "microbatch_layout",
    "peak_bytes",
    "split_microbatches",
]
