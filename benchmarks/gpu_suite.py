"""The device check, in one run: every accelerator benchmark in turn, each in its own process with a time limit, and
one JSON object on the last line holding each script's JSON (or why it has none).

Run it once where a GPU is lent (``python benchmarks/gpu_suite.py``; ``--quick`` passes ``--quick`` on, for a
rehearsal on CPU). The scripts: ``gpu_kernels.py`` (achieved matmul and memory rates), ``gpu_memory.py`` (remat and
precision, compiled and measured against the cost model), ``gpu_mfu.py`` (the GPT's model FLOPs utilisation) and
``bridges.py`` (the torch drop-in against torch DDP on the device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ("gpu_kernels.py", "gpu_memory.py", "gpu_mfu.py", "bridges.py")
LIMIT_S = 150
"""Seconds each script may take: four of them fit a 10-minute device call."""


def run(script: str, quick: bool) -> dict:
    """The last-line JSON of ``script``, or ``{"error": ...}`` naming why there is none."""
    cmd = [sys.executable, os.path.join(HERE, script), *(["--quick"] if quick else [])]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"over {LIMIT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
    try:
        out = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"last line is not JSON: {lines[-1][:200]}"}
    out["suite_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    print(json.dumps({script: run(script, quick) for script in SCRIPTS}))


if __name__ == "__main__":
    main()
