"""Bundled demo models (used by examples, the CLI demo, tests and benchmarks)."""
