"""The documentation holds together: every page under docs/ is in mkdocs.yml's nav, every local link in the README
points at a file that exists, and the site builds with ``mkdocs build --strict`` (a broken link, anchor, snippet
or API reference fails it)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _nav_pages(node) -> set[str]:
    """Every page a mkdocs nav names, at any depth."""
    if isinstance(node, str):
        return {node}
    if isinstance(node, dict):
        return set().union(*(_nav_pages(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_nav_pages(v) for v in node))
    return set()


def test_every_docs_page_is_in_the_nav_and_every_readme_link_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages, "docs/ holds no pages"
    assert pages <= nav, f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav <= pages, f"nav entries with no page under docs/: {sorted(nav - pages)}"

    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", readme)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert local, "the README links to no local file"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mkdocs_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "index.html").is_file()
