"""Run one case of a Keras test file in a fresh process (Keras picks its backend and JAX its devices at import):
8 simulated CPU devices, the jax backend, and the case's ``RESULT {json}`` line parsed."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_case(script: str, case: str, tmp_path, timeout: int) -> dict:
    """The ``RESULT`` of ``python script case tmp_path/case``."""
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [sys.executable, os.path.abspath(script), case, str(tmp_path / case)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[7:])
