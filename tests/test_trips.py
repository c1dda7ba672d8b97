"""scripts/trips.py's counting machinery on a tiny package, not on a model: the files a call
enters on every thread, the floors of the import graph (cycles, re-exports, function-level imports) and the
climbs back up (a callback that a low file calls into a high one)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # scripts/trips.py, a measuring script, not the product: make test-bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trips():
    spec = importlib.util.spec_from_file_location("trips_script", ROOT / "scripts" / "trips.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def tinypkg(tmp_path, monkeypatch):
    """low <- mid <- high by imports; high hands low a callback through mid (low calls back up into high);
    `helpers/` sits outside the package (a library: its frames are skipped when finding a caller)."""
    _write(tmp_path, {
        "tinypkg/__init__.py": "from tinypkg.low import call_back  # a re-export\n",
        "tinypkg/low.py": """
            def call_back(cb):
                import helperlib
                return helperlib.relay(cb)
        """,
        "tinypkg/mid.py": """
            from tinypkg import call_back

            def run(cb):
                return call_back(cb)
        """,
        "tinypkg/high.py": """
            from tinypkg import mid

            def callback():
                return 42

            def main():
                return mid.run(callback)

            def unused():
                return 0
        """,
        "helperlib.py": """
            def relay(fn):
                return fn()
        """,
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n == "tinypkg" or n.startswith("tinypkg.") or n == "helperlib"]:
        del sys.modules[name]


def test_floors_follow_the_import_graph(trips, tinypkg):
    tree = trips.ProjectTree(tinypkg, {"tinypkg": "tinypkg"})
    graph = tree.import_graph()
    # the __init__ is no node; `from tinypkg import call_back` (a re-export) is an import of low.py; an
    # import of a library (function-level) is no edge
    assert graph == {"tinypkg/low.py": set(), "tinypkg/mid.py": {"tinypkg/low.py"},
                     "tinypkg/high.py": {"tinypkg/mid.py"}}
    assert tree.floors() == {"tinypkg/low.py": 0, "tinypkg/mid.py": 1, "tinypkg/high.py": 2}


def test_a_cycle_shares_one_floor(trips):
    graph = {"a": {"b"}, "b": {"a", "leaf"}, "leaf": set(), "top": {"a"}, "c": {"d"}, "d": {"c"}}
    assert trips.floors(graph) == {"leaf": 0, "a": 1, "b": 1, "top": 2, "c": 0, "d": 0}
    comps = trips.strongly_connected(graph)
    assert sorted(comps) == [["a", "b"], ["c", "d"], ["leaf"], ["top"]]


def test_relative_and_function_level_imports(trips, tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from .deep import thing\n",
        "pkg/sub/deep.py": "thing = 1\n",
        "pkg/base.py": "",
        "pkg/user.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from . import base
            def late():
                from .sub import thing
                return thing
        """,
    })
    tree = trips.ProjectTree(tmp_path, {"pkg": "pkg"})
    assert tree.import_graph()["pkg/user.py"] == {"pkg/base.py", "pkg/sub/deep.py"}
    assert tree.floors()["pkg/user.py"] == 1


def test_a_callback_climbs_back_up_on_another_thread(trips, tinypkg):
    tree = trips.ProjectTree(tinypkg, {"tinypkg": "tinypkg"})
    tracer = trips.TripTracer(tree)
    from tinypkg import high

    with trips.traced(tracer):
        high.unused()  # before the window: not counted
        with tracer.window():
            worker = threading.Thread(target=high.main)  # started after install: carries the hook
            worker.start()
            worker.join()
        high.unused()  # after it: not counted either
    trip = tracer.result("tiny")
    assert trip.file_list == ["tinypkg/high.py", "tinypkg/low.py", "tinypkg/mid.py"]
    assert trip.files == 3
    # low -> high is the callback, through helperlib (its frame skipped): the one climb
    assert tracer.pairs == {("tinypkg/high.py", "tinypkg/mid.py"), ("tinypkg/mid.py", "tinypkg/low.py"),
                            ("tinypkg/low.py", "tinypkg/high.py")}
    assert trip.climb_list == [["tinypkg/low.py", "tinypkg/high.py"]]
    assert trip.as_json() == {"trip": "tiny", "files": 3, "climbs": 1,
                              "file_list": ["tinypkg/high.py", "tinypkg/low.py", "tinypkg/mid.py"],
                              "climb_list": [["tinypkg/low.py", "tinypkg/high.py"]]}
    assert sys.getprofile() is None and threading.getprofile() is None


def test_nothing_is_recorded_outside_a_window(trips, tinypkg):
    tree = trips.ProjectTree(tinypkg, {"tinypkg": "tinypkg"})
    tracer = trips.TripTracer(tree)
    from tinypkg import high

    with trips.traced(tracer):
        high.main()
        with tracer.window():
            high.unused()
    trip = tracer.result("tiny")
    assert (trip.file_list, trip.climb_list) == (["tinypkg/high.py"], [])


def test_project_roots_map_the_repository(trips):
    """The real tree: every project folder is read, __init__ files are no nodes, and every file stands above what
    it imports (or level with it, in a cycle)."""
    tree = trips.ProjectTree(ROOT)
    graph = tree.import_graph()
    floor_of = tree.floors()
    assert len(floor_of) > 40
    assert {f.split("/")[0] for f in floor_of} == {"orthrus_rag", "retrievers", "pipelines", "data"}
    assert not any(f.endswith("__init__.py") for f in floor_of)
    assert tree.rel(str(ROOT / "scripts" / "trips.py")) is None
    assert tree.rel(str(ROOT / "orthrus_rag" / "__init__.py")) is None
    in_cycle = {f for comp in trips.strongly_connected(graph) if len(comp) > 1 for f in comp}
    for f, imported in graph.items():
        for g in imported:
            assert floor_of[f] > floor_of[g] or (f in in_cycle and floor_of[f] == floor_of[g]), (f, g)


def test_builders_are_found_where_they_live(trips, tinypkg, monkeypatch):
    """A builder is taken from the first of its modules that exists (today's home, then its former one)."""
    monkeypatch.setitem(trips.BUILDERS, "call_back", ("tinypkg.moved_away", "tinypkg.low"))
    monkeypatch.setitem(trips.BUILDERS, "nowhere", ("tinypkg.moved_away",))
    from tinypkg import low

    assert trips.builder("call_back") is low.call_back
    with pytest.raises(ImportError, match="nowhere is in none of tinypkg.moved_away"):
        trips.builder("nowhere")
