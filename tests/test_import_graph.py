"""The package's import graph has no circle (issue 32): a reader can learn every
module from the ones below it, and a change above cannot break what is below.

`lint-imports` keeps the layers named in `.importlinter`; this test keeps the rest:
it finds every strongly connected set of `fedring` modules (imports inside functions
and under `TYPE_CHECKING` count, as grimp reads them) and wants none."""

from __future__ import annotations

import grimp


def _circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in graph.find_modules_directly_imported_by(node):
            if not nxt.startswith("fedring"):
                continue
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for module in sorted(graph.modules):
        if module.startswith("fedring") and module not in order:
            visit(module)
    return found


def test_no_module_of_fedring_imports_itself_through_others() -> None:
    graph = grimp.build_graph("fedring")
    assert len(graph.modules) > 150  # the whole package was read
    assert _circles(graph) == []


def test_the_check_sees_a_circle() -> None:
    graph = grimp.ImportGraph()
    for name in ("fedring.a", "fedring.b", "fedring.c"):
        graph.add_module(name)
    graph.add_import(importer="fedring.a", imported="fedring.b")
    graph.add_import(importer="fedring.b", imported="fedring.a")
    graph.add_import(importer="fedring.c", imported="fedring.a")
    assert _circles(graph) == [["fedring.a", "fedring.b"]]
