"""The README's quick start runs as written, and it opens with the install/run command and the two test commands."""

import math
import pathlib
import re

import jax
import pytest

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_opens_with_the_run_and_test_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert first_block == [
        "pip install -e . && python examples/train_gpt.py",
        'pip install -e ".[test,torch,tf]" && python -m pytest -q',
        "python -m pytest -q -m slow",
    ]
    ci = (pathlib.Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert first_block[1] in ci and first_block[2] in ci


@pytest.mark.slow  # 12 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_quick_start_runs_and_trains():
    code = re.search(r"## Quick start.*?```python\n(.*?)```", README, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    assert int(scope["state"].step) == 1
    assert math.isfinite(float(scope["metrics"]["loss"]))
    assert scope["plan"].zero_stage == 3
    keep = re.search(r"### Or keep the step you have.*?```python\n(.*?)```", README, re.S).group(1)
    exec(compile(keep, "README.md", "exec"), scope)  # noqa: S102 - continues the quick start's scope
    assert math.isfinite(float(scope["metrics"]["loss"])) and int(scope["flax_state"].step) == 1
    assert scope["plain_step"].layout.describe() == "parameters at state[0], optimizer state at state[1]"
    assert scope["flax_state"].params["Dense_0"]["kernel"].sharding.spec == jax.P(None, ("data", "fsdp"))
    anything = re.search(r"### Or keep the step you have.*?```python\n.*?```.*?```python\n(.*?)```", README, re.S)
    exec(compile(anything.group(1), "README.md", "exec"), scope)  # noqa: S102 - the nnx tutorial-style step
    assert int(scope["optimizer"].step[...]) == 1 and math.isfinite(float(scope["metrics"].compute()["loss"]))
    assert scope["model"].l1.kernel[...].sharding.spec == jax.P(None, ("data", "fsdp"))
