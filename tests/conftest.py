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

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 simulated CPU devices, found {jax.device_count()}"
