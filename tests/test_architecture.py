"""The architecture holds: one dependency order (import-linter's layers contract in pyproject.toml), and every
docstring example in the package runs and prints what it says."""

import doctest
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys

import pytest

import openhosti_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(openhosti_jax.__path__, "openhosti_jax.") if not m.name.endswith("__main__")
)


@pytest.mark.slow  # runs lint-imports in a process
@pytest.mark.timeout(300)
def test_layers_contract_is_kept():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    run = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "1 kept, 0 broken" in run.stdout


SLOW_EXAMPLES = {
    "openhosti_jax.demo.gpt_job",  # trains the demo (7 s)
    "openhosti_jax.checkpoint.restart",  # starts the supervised command
    "openhosti_jax.mesh.launch",  # starts local processes
    "openhosti_jax.bridges.tensors",  # imports TensorFlow, which starts a process
    "openhosti_jax.bridges.tf_compute",
    "openhosti_jax.bridges.tf_data",
}
"""Modules whose examples train a model or start processes: the slow suite runs them."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_EXAMPLES else m for m in MODULES]
)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name} (output above)"


def test_every_error_raised_on_purpose_is_an_openhosti_error():
    """``raise X(...)`` names a class of `openhosti_jax.errors` (a typed error a caller can catch by kind), except
    the protocol signals Python itself defines (iteration's end, a missing attribute, an abstract method)."""
    import ast
    import builtins
    import pathlib

    import openhosti_jax
    from openhosti_jax import errors

    protocol = {"StopIteration", "AttributeError", "NotImplementedError"}
    root = pathlib.Path(openhosti_jax.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call | ast.Name):
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
                kind = (getattr(errors, name, None) or getattr(builtins, name, None)) if name else None
                if isinstance(kind, type) and issubclass(kind, BaseException):
                    if not issubclass(kind, errors.OpenhostiError) and name not in protocol:
                        found.append(f"{path.relative_to(root)}:{node.lineno} raises {name}")
    assert not found, found


def test_no_package_attribute_hides_a_submodule():
    """``openhosti_jax.pkg.name`` is the submodule ``pkg/name.py`` or nothing: a function re-exported under its
    module's name would make the attribute mean one thing or the other depending on what was imported first."""
    import types

    packages = ["openhosti_jax"] + [
        m.name for m in pkgutil.walk_packages(openhosti_jax.__path__, "openhosti_jax.") if m.ispkg
    ]
    hidden = []
    for name in packages:
        package = importlib.import_module(name)
        for sub in pkgutil.iter_modules(package.__path__):
            value = getattr(package, sub.name, None)
            if value is not None and not (
                isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{sub.name}"
            ):
                hidden.append(f"{name}.{sub.name} is {type(value).__name__} {value!r}, not the submodule")
    assert len(packages) > 10, packages
    assert not hidden, hidden


def test_tests_that_need_an_optional_framework_carry_its_mark():
    """``-m "not torch"`` / ``-m "not tf"`` deselect every test that needs that extra: a test module that imports
    torch (or TensorFlow / Keras) is marked ``torch`` (``tf``)."""
    import pathlib
    import re

    needs = {
        "torch": re.compile(
            r"^\s*(import torch|torch = pytest\.importorskip|from openhosti_jax\.frontends\.torch)", re.M
        ),
        "tf": re.compile(r"importorskip\(\"(tensorflow|keras)\"\)|^\s*import (tensorflow|keras)\b", re.M),
    }
    unmarked = []
    for path in sorted(pathlib.Path(ROOT, "tests").rglob("test_*.py")):
        text = path.read_text()
        for mark, pattern in needs.items():
            if pattern.search(text) and f"mark.{mark}" not in text:
                unmarked.append(f"{path.relative_to(ROOT)} needs the {mark} mark")
    assert not unmarked, unmarked
