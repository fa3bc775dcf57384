"""Print openhosti_jax's package-level import graph (function-level imports included) and any package cycle.

Run from the repository root: ``python .ci/import_graph.py``. The order itself is enforced by the import-linter
layers contract in pyproject.toml (``lint-imports``), which tests/test_architecture.py runs.
"""

import collections

import grimp


def main() -> None:
    graph = grimp.build_graph("openhosti_jax")
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for module in graph.modules:
        parts = module.split(".")
        if len(parts) < 2:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            target = imported.split(".")[1] if "." in imported else None
            if target and target != parts[1]:
                edges[parts[1]].add(target)
    for package in sorted(edges):
        print(f"{package:12} -> {', '.join(sorted(edges[package]))}")

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    print("packages on a cycle:", ", ".join(sorted(p for p in edges if p in reaches(p))) or "none")


if __name__ == "__main__":
    main()
