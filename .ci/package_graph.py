"""Print the house plan of openhosti_jax: the layers contract, the package graph, and the public names.

Run from the repository root: ``python .ci/package_graph.py``. It prints

1. the import-linter layers contract from pyproject.toml (top layer first; ``lint-imports`` enforces it);
2. for each subpackage (and top-level module) of openhosti_jax, the other ones it imports, read from the AST of
   every module (imports inside functions included), and any that sit on a cycle;
3. the public names: ``openhosti_jax.__all__`` and each subpackage's ``__all__``.
"""

import ast
import importlib
import pathlib
import pkgutil
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "openhosti_jax"


def unit_of(path: pathlib.Path) -> str:
    """The first name under the package: a subpackage's folder or a top-level module's stem."""
    parts = path.relative_to(ROOT / PACKAGE).parts
    return parts[0] if len(parts) > 1 else pathlib.Path(parts[0]).stem


def imported_units(tree: ast.AST, units: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == PACKAGE:  # from openhosti_jax import errors
                names = [f"{PACKAGE}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == PACKAGE and len(parts) > 1 and parts[1] in units:
                found.add(parts[1])
    return found


def package_graph() -> dict[str, set[str]]:
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    units = {unit_of(f) for f in files} - {"__init__", "__main__"}
    edges: dict[str, set[str]] = {u: set() for u in sorted(units)}
    for path in files:
        unit = unit_of(path)
        if unit not in units:
            continue
        edges[unit] |= imported_units(ast.parse(path.read_text()), units) - {unit}
    return edges


def on_cycle(edges: dict[str, set[str]]) -> list[str]:
    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return sorted(u for u in edges if u in reaches(u))


def main() -> None:
    sys.path.insert(0, str(ROOT))
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    print("## layers contract (pyproject.toml, top first)")
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract.get("type") == "layers":
            for layer in contract["layers"]:
                print(f"  {layer}")

    print("\n## package graph (AST of every module)")
    edges = package_graph()
    for unit, targets in edges.items():
        print(f"  {unit:12} -> {', '.join(sorted(targets)) or '-'}")
    print(f"  on a cycle: {', '.join(on_cycle(edges)) or 'none'}")

    print("\n## public names (__all__)")
    package = importlib.import_module(PACKAGE)
    print(f"  {PACKAGE}: {', '.join(package.__all__)}")
    for info in sorted(pkgutil.walk_packages(package.__path__, f"{PACKAGE}."), key=lambda m: m.name):
        if info.ispkg:
            module = importlib.import_module(info.name)
            names = getattr(module, "__all__", None)
            print(f"  {info.name}: {', '.join(names) if names is not None else '(no __all__)'}")


if __name__ == "__main__":
    main()
