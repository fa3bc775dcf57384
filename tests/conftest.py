"""Force 8 simulated CPU devices before jax is imported by any test module."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# measured device profiles go to one directory per test session (shared with the processes tests start), not ~/.cache
if "OPENHOSTI_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["OPENHOSTI_CACHE_DIR"] = tempfile.mkdtemp(prefix="openhosti-test-cache-")

# the persistent compile cache (on by default) is off in this process: the slow tests that start processes turn it on
# in theirs (tests/test_compile_cache.py), and one suite's cached steps do not decide another's results
os.environ.setdefault("OPENHOSTI_COMPILE_CACHE", "0")

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 simulated CPU devices, found {jax.device_count()}"


import subprocess  # noqa: E402

import pytest  # noqa: E402


class _NoProcesses:
    def __init__(self, *args, **kwargs):
        raise AssertionError(
            "a test in the fast suite started a process: mark it @pytest.mark.slow with a @pytest.mark.timeout sized "
            "to it (the fast suite runs no processes, so nothing in it can hang on one)"
        )


@pytest.fixture(autouse=True)
def _processes_only_in_the_slow_suite(request, monkeypatch):
    """The fast suite starts no processes: a test that does belongs to the slow suite, with a timeout."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setattr(subprocess, "Popen", _NoProcesses)
    yield


def pytest_collection_modifyitems(config, items):
    """Every slow test carries its own timeout (processes and collectives can hang; 600 s is the ceiling)."""
    untimed = [i.nodeid for i in items if i.get_closest_marker("slow") and not i.get_closest_marker("timeout")]
    if untimed:
        raise pytest.UsageError(f"slow tests need @pytest.mark.timeout(seconds) sized to them: {untimed[:20]}")
