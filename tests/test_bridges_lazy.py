"""Neither torch, tensorflow, keras nor equinox is imported by ``import openhosti_jax``, ``openhosti_jax.bridges``
or the front doors' packages (``openhosti_jax.frontends``, ``openhosti_jax.frontends.keras``)."""

import subprocess
import sys

import pytest


@pytest.mark.slow  # imports the library in a fresh process
@pytest.mark.timeout(120)
def test_frameworks_are_imported_lazily():
    code = (
        "import sys, openhosti_jax, openhosti_jax.bridges as b, openhosti_jax.frontends.keras as k; "
        "assert callable(b.to_torch) and callable(b.wrap_for_tf) and k.Strategy; "
        "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'equinox') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True)
    assert out.stdout.strip() == "[]"
