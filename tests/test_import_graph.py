"""Lower layers never import upward: the modules of the package form no import cycle, counting every import
(function-level ones too: a late import hides a cycle, it does not remove it; and those under `if TYPE_CHECKING:`:
a type-only import is still an arrow a reader follows). Package `__init__` re-exports are left out: they import
everything by design."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"orthrus_rag": ROOT / "orthrus_rag", "orthrus_rag.retrievers": ROOT / "retrievers",
           "orthrus_rag.pipelines": ROOT / "pipelines", "orthrus_rag.data": ROOT / "data"}


def _modules() -> dict[str, Path]:
    mods = {}
    for prefix, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            if path.name == "__init__.py" or ".venv" in path.parts:
                continue
            rel = path.relative_to(folder).with_suffix("")
            name = ".".join([prefix, *rel.parts])
            if prefix == "orthrus_rag" and rel.parts[0] in ("retrievers", "pipelines", "data"):
                continue
            mods[name] = path
    return mods


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    mods = _modules()
    graph = {name: {n for n in _imports(path) if n in mods and n != name} for name, path in mods.items()}
    assert len(graph) > 40
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_type_only_imports_are_counted():
    """The policies see the scheduler through its base `SchedulerQueues` (defined beside them), not by importing
    it (type-only or not)."""
    mods = _modules()
    assert "orthrus_rag.engine.core.scheduler" not in _imports(mods["orthrus_rag.engine.core.policies"])
    assert "orthrus_rag.engine.core.policies" in _imports(mods["orthrus_rag.engine.core.scheduler"])


def test_config_and_loading_stay_low():
    """The config's nodes (the engine's dataclasses, the CLI's) import nothing of the engine; only the mapping
    and the checks ask the engine's owners (the policy registry, the deployments)."""
    mods = _modules()
    for node in ("orthrus_rag.config.engine", "orthrus_rag.config.app"):
        assert not {n for n in _imports(mods[node]) if n.startswith(("orthrus_rag.engine", "orthrus_rag.pipelines",
                                                                     "orthrus_rag.retrievers"))}, node
    assert "orthrus_rag.engine.engine" not in _imports(mods["orthrus_rag.engine.executor.loading"])
