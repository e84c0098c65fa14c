"""No import cycle between any two modules of the repository.

The package layering is checked by `lint-imports` (contracts in pyproject.toml, run by `make test`);
those contracts see cycles between packages but not one between files inside a package, so this test
walks the module graph itself. Imports under TYPE_CHECKING count too.
"""

from __future__ import annotations

import grimp
import pytest

ROOT_PACKAGES = (
    "specserve_types", "cluster", "drafter_service", "verifier_service", "kv_manager", "model_runtime", "deploy",
)


def strongly_connected(graph: grimp.ImportGraph) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative), only those that hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    work: list[tuple[str, list[str]]] = []  # depth-first path: module, imports not yet followed

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        work.append((module, sorted(graph.find_modules_directly_imported_by(module))))

    for start in sorted(graph.modules):
        if start in index:
            continue
        visit(start)
        while work:
            module, pending = work[-1]
            if pending:
                child = pending.pop()
                if child not in index:
                    visit(child)
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1 or module in graph.find_modules_directly_imported_by(module):
                    found.append(component)
    return found


def shortest_cycle(graph: grimp.ImportGraph, component: set[str]) -> tuple[str, ...]:
    """A shortest import cycle through the component's first module: a -> ... -> a."""
    first = min(component)
    best: tuple[str, ...] | None = None
    for imported in sorted(graph.find_modules_directly_imported_by(first) & component):
        back = (first,) if imported == first else graph.find_shortest_chain(imported, first)
        assert back is not None, f"{imported} is in {first}'s component but does not reach it"
        if best is None or len(back) + 1 < len(best):
            best = (first, *back)
    assert best is not None
    return best


def describe(graph: grimp.ImportGraph, components: list[set[str]]) -> str:
    return "\n".join(" -> ".join(shortest_cycle(graph, c)) + f"  ({len(c)} modules in the cycle set)"
                     for c in components)


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.e")]:
        graph.add_import(importer=importer, imported=imported)
    components = strongly_connected(graph)
    assert sorted(sorted(c) for c in components) == [["p.a", "p.b", "p.c"], ["p.e"]]
    assert sorted(describe(graph, components).splitlines()) == [
        "p.a -> p.b -> p.c -> p.a  (3 modules in the cycle set)", "p.e -> p.e  (1 modules in the cycle set)",
    ]


@pytest.fixture(scope="module")
def repo_graph() -> grimp.ImportGraph:
    return grimp.build_graph(*ROOT_PACKAGES, cache_dir=None)


def test_graph_covers_every_package(repo_graph: grimp.ImportGraph) -> None:
    assert {m.split(".")[0] for m in repo_graph.modules} == set(ROOT_PACKAGES)
    assert "cluster.engine.engine" in repo_graph.find_modules_directly_imported_by("cluster.engine.factory")


def test_no_import_cycle_between_modules(repo_graph: grimp.ImportGraph) -> None:
    components = strongly_connected(repo_graph)
    assert not components, "import cycles:\n" + describe(repo_graph, components)
