"""Trips: which project source files run code for ONE request, and how often a call climbs back up.

    .venv/bin/python scripts/trips.py --trip all        # chat, embedding, embedding-adapter, iter-retgen
    .venv/bin/python scripts/trips.py --trip chat
    .venv/bin/python scripts/trips.py --trip all --tree /tmp/head   # another checkout (e.g. `git archive HEAD`)

What is counted, exactly:

- **Project files**: the `.py` files under `orthrus_rag/`, `retrievers/`, `pipelines/` and `data/` of the measured
  tree (installed as `orthrus_rag`, `orthrus_rag.retrievers`, `orthrus_rag.pipelines`, `orthrus_rag.data`); not
  `scripts/`, `tests/`, `conf/`, `.venv` or any library. **Package `__init__.py` files are left out of both the
  counts and the floors**: an import of a package is read as an import of the modules it re-exports the imported
  names from (the modules its own imports name, when the name is defined in the `__init__` itself).
- **The window**: one request, after a warm-up request of the same kind has run on the same engine (so import-time,
  model-load, kernel-build and first-use code is not counted), from just before the request is sent until its
  answer is back and the engine thread is idle again (a 0.3 s settle).
- **A file is entered** when, inside the window, on any thread (the hook is installed with `threading.setprofile`
  and `sys.setprofile` before the warm-up, so the engine's background thread, the test client's event-loop thread
  and the executor threads all carry it), a profiler `'call'` event lands in its code (a function, method, lambda,
  comprehension, or a generator / coroutine entered or resumed), or code in it makes such a call (a loop already
  running when the window opened, e.g. the engine thread's, counts by the calls it makes).
- **A call's caller file** is the file of the nearest project frame below the callee on the same thread's stack:
  library and stdlib frames in between are skipped (a callback passed through asyncio, torch or Starlette counts
  from the project file that handed it over); a call with no project frame below it (an event loop resuming a
  task, the web framework calling a route) has no caller.
- **Floors**: from the static import graph of the project files (ast; every `import` / `from ... import`, at module
  level, inside functions and under `if TYPE_CHECKING:`; relative imports resolved). A file's floor is 1 + the
  highest floor among the project files it imports, 0 when it imports none; the files of one import cycle (a
  strongly connected component) share a floor, computed over the cycle's imports out of it.
- **A climb back up** is a call whose callee file stands on a higher floor than its caller file; climbs are
  counted once per distinct (caller file, callee file) pair.

The trips, each over the project's own builders (the functions `orthrus-rag serve` / `orthrus-rag run` call):

- `chat`: POST /v1/chat/completions (`max_tokens` 4, temperature 0) through `build_app(build_client(cfg), ...)` for
  the default `orthrus-rag serve` config (in-process engine, `deploy=engine`), in process via Starlette's
  TestClient.
- `embedding`: POST /v1/embeddings (one input) on the default embedding model of the same server (the default
  config's separate encoder).
- `embedding-adapter`: POST /v1/embeddings on the shared backbone under its embedding adapter (`model=
  smollm2_backbone`, the shipped `smollm2_embed` LoRA), the default config having none.
- `iter-retgen`: one 2WikiMultihopQA dev question through Iter-RetGen over the flat FAISS retriever, as
  `orthrus-rag run dataset=2wiki dataset.path=...` builds it (validate, RunSession, build_client, build_retriever,
  build_pipeline, step observer, `session.record` of each record of `pipeline.stream(...)`), with `dataset.limit=2`,
  `pipeline.max_tokens=8`, `pipeline.max_concurrency=1`: question 0 warms up, question 1 is measured.

Output: one JSON line per trip (`{"trip", "files", "climbs", "file_list", "climb_list"}`), then a table.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

logger = logging.getLogger("trips")
REPO = Path(__file__).resolve().parents[1]
# package name -> folder, relative to the tree (pyproject's package-dir)
PROJECT_ROOTS = {"orthrus_rag": "orthrus_rag", "orthrus_rag.retrievers": "retrievers",
                 "orthrus_rag.pipelines": "pipelines", "orthrus_rag.data": "data"}
TARGETS = {"chat": 22, "embedding": 16, "embedding-adapter": 16, "iter-retgen": 30}  # most project files a trip enters
MAX_CLIMBS = 2
TRIPS = ("chat", "embedding", "embedding-adapter", "iter-retgen")
SETTLE_S = 0.3


# ---- the project's files and their import graph --------------------------------------------------------------
class ProjectTree:
    """The project files under `base` (package name -> folder relative to `base`), their static import graph and
    floors. Package `__init__.py` files are not nodes: importing a package means importing what it re-exports."""

    def __init__(self, base: Path, roots: dict[str, str] | None = None) -> None:
        self.base = base.resolve()
        self.roots = {name: (self.base / folder).resolve() for name, folder in (roots or PROJECT_ROOTS).items()}
        self.modules: dict[str, Path] = {}  # module name -> file (a package: its __init__.py)
        self.packages: set[str] = set()
        for prefix, folder in self.roots.items():
            for path in sorted(folder.rglob("*.py")):
                parts = path.relative_to(folder).with_suffix("").parts
                if any(p.startswith(".") or p == "__pycache__" for p in parts):
                    continue
                if parts[-1] == "__init__":
                    name = ".".join([prefix, *parts[:-1]])
                    self.packages.add(name)
                else:
                    name = ".".join([prefix, *parts])
                if self._owner(path) == folder:  # NOTE: a root nested inside another root belongs to itself
                    self.modules[name] = path.resolve()
        self._rel_cache: dict[str, str | None] = {}
        self._package_all: dict[str, set[Path]] = {}
        self._package_names: dict[str, dict[str, set[Path]]] = {}

    def _owner(self, path: Path) -> Path | None:
        path = path.resolve()
        owners = [f for f in self.roots.values() if path.is_relative_to(f)]
        return max(owners, key=lambda f: len(f.parts), default=None)

    def rel(self, filename: str) -> str | None:
        """`filename` relative to the tree if it is a project file (not an `__init__.py`), else None. Cached."""
        try:
            return self._rel_cache[filename]
        except KeyError:
            pass
        rel = None
        if filename and not filename.startswith("<"):
            path = Path(filename).resolve()
            if path.suffix == ".py" and path.name != "__init__.py" and self._owner(path) is not None:
                rel = path.relative_to(self.base).as_posix()
        self._rel_cache[filename] = rel
        return rel

    def files(self) -> list[Path]:
        return sorted(p for name, p in self.modules.items() if name not in self.packages)

    # -- imports
    def _module_name(self, path: Path) -> tuple[str, bool]:
        for name, p in self.modules.items():
            if p == path:
                return name, name in self.packages
        raise KeyError(path)

    @staticmethod
    def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
        if node.level == 0:
            return node.module or ""
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, node.module] if node.module else base)

    def _targets_of_module(self, name: str) -> set[Path]:
        if name in self.packages:
            return self._all_of_package(name)
        if name in self.modules:
            return {self.modules[name]}
        return set()

    def _targets_of_name(self, module: str, name: str) -> set[Path]:
        sub = f"{module}.{name}"
        if sub in self.modules:
            return self._targets_of_module(sub)
        if module in self.packages:
            bound = self._names_of_package(module).get(name)
            return set(bound) if bound is not None else self._all_of_package(module)
        return self._targets_of_module(module)

    def _import_targets(self, path: Path) -> Iterator[set[Path]]:
        """The project files each imported name of `path` comes from (every import statement, at any depth)."""
        module, is_package = self._module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield self._targets_of_module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(node, module, is_package)
                for alias in node.names:
                    if alias.name == "*":
                        yield self._targets_of_module(source)
                    else:
                        yield self._targets_of_name(source, alias.name)

    def _all_of_package(self, package: str) -> set[Path]:
        """Every project file a package's `__init__` imports (re-exported or used by code defined there)."""
        if package not in self._package_all:
            self._package_all[package] = set()  # NOTE: guards packages that import each other
            out: set[Path] = set()
            for targets in self._import_targets(self.modules[package]):
                out |= targets
            self._package_all[package] = out
        return self._package_all[package]

    def _names_of_package(self, package: str) -> dict[str, set[Path]]:
        """Name bound by a `from ... import` in a package's `__init__` -> the files it comes from."""
        if package not in self._package_names:
            self._package_names[package] = {}
            names: dict[str, set[Path]] = {}
            module, _ = self._module_name(self.modules[package])
            for node in ast.walk(ast.parse(self.modules[package].read_text())):
                if isinstance(node, ast.ImportFrom):
                    source = self._absolute(node, module, True)
                    for alias in node.names:
                        if alias.name != "*":
                            names[alias.asname or alias.name] = self._targets_of_name(source, alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.asname:
                            names[alias.asname] = self._targets_of_module(alias.name)
            self._package_names[package] = names
        return self._package_names[package]

    def import_graph(self) -> dict[str, set[str]]:
        """Repo-relative file -> the project files it imports (anywhere in it), itself left out."""
        graph: dict[str, set[str]] = {}
        for path in self.files():
            me = path.relative_to(self.base).as_posix()
            targets: set[str] = set()
            for found in self._import_targets(path):
                targets |= {p.relative_to(self.base).as_posix() for p in found if p.name != "__init__.py"}
            graph[me] = targets - {me}
        return graph

    def floors(self) -> dict[str, int]:
        return floors(self.import_graph())


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (each a sorted list), iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                comps.append(sorted(comp))
    return comps


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """File -> floor: 0 for a file importing no project file, else 1 + the highest floor it imports; the files of
    an import cycle share one floor, computed over the imports leaving the cycle."""
    comps = strongly_connected(graph)
    comp_of = {f: i for i, comp in enumerate(comps) for f in comp}
    comp_floor: dict[int, int] = {}
    # Tarjan emits a component after every component it reaches: one pass in that order suffices
    for i, comp in enumerate(comps):
        deps = {comp_of[t] for f in comp for t in graph[f] if t in comp_of} - {i}
        comp_floor[i] = 1 + max((comp_floor[d] for d in deps), default=-1)
    return {f: comp_floor[comp_of[f]] for f in graph}


# ---- the run-time trace ------------------------------------------------------------------------------------------
@dataclass
class Trip:
    trip: str
    file_list: list[str]
    climb_list: list[list[str]]
    floors: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def files(self) -> int:
        return len(self.file_list)

    @property
    def climbs(self) -> int:
        return len(self.climb_list)

    def as_json(self) -> dict[str, Any]:
        return {"trip": self.trip, "files": self.files, "climbs": self.climbs, "file_list": self.file_list,
                "climb_list": self.climb_list}


class TripTracer:
    """A profile hook on every thread (`threading.setprofile` for threads started after `install`, `sys.setprofile`
    for this one) that records, while a window is open, the project files entered and the (caller file, callee
    file) pairs of the calls into them. Install before the warm-up, so threads the warm-up starts carry it."""

    def __init__(self, tree: ProjectTree, floor_of: dict[str, int] | None = None) -> None:
        self.tree = tree
        self.floor_of = floor_of if floor_of is not None else tree.floors()
        self.active = False
        self.entered: set[str] = set()
        self.pairs: set[tuple[str, str]] = set()
        self._installed_at: set[int] = set()

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active or event != "call":
            return
        rel = self.tree.rel
        callee = rel(frame.f_code.co_filename)
        if callee is None:
            return
        self.entered.add(callee)
        below = frame.f_back
        while below is not None:
            caller = rel(below.f_code.co_filename)
            if caller is not None:
                self.entered.add(caller)
                if caller != callee:
                    self.pairs.add((caller, callee))
                return
            below = below.f_back

    def install(self) -> None:
        self._installed_at = {t.ident for t in threading.enumerate() if t is not threading.main_thread()}
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)

    def uninstall(self) -> None:
        self.active = False
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        older = [t.name for t in threading.enumerate() if t.ident in self._installed_at and t.is_alive()]
        if older:
            logger.warning("threads started before the hook was installed are not traced: %s", ", ".join(older))
        self.entered, self.pairs = set(), set()
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def result(self, trip: str) -> Trip:
        floor_of = self.floor_of
        climbs = sorted([a, b] for a, b in self.pairs
                        if a in floor_of and b in floor_of and floor_of[b] > floor_of[a])
        return Trip(trip, sorted(self.entered), climbs, {f: floor_of.get(f, -1) for f in self.entered})


@contextlib.contextmanager
def traced(tracer: TripTracer) -> Iterator[TripTracer]:
    tracer.install()
    try:
        yield tracer
    finally:
        tracer.uninstall()


def measure(tracer: TripTracer, trip: str, request: Callable[[], Any], settle_s: float = SETTLE_S) -> Trip:
    """Run `request` inside a window (then let the engine thread go idle) and return what it entered."""
    with tracer.window():
        request()
        time.sleep(settle_s)
    return tracer.result(trip)


# ---- importing another tree ----------------------------------------------------------------------------------
class _TreeFinder(importlib.abc.MetaPathFinder):
    """Imports `orthrus_rag` (and its installed subpackages: retrievers/, pipelines/, data/, conf/) from a tree."""

    def __init__(self, base: Path) -> None:
        roots = {**PROJECT_ROOTS, "orthrus_rag.conf": "conf"}
        self.mapping = {name: (base / folder).resolve() for name, folder in roots.items()}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        folder = self.mapping.get(fullname)
        if folder is not None:
            return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])
        if fullname.startswith("orthrus_rag."):  # NOTE: before the editable install's finder sees it
            return importlib.machinery.PathFinder.find_spec(fullname, path)
        return None


def use_tree(base: Path) -> None:
    if any(name == "orthrus_rag" or name.startswith("orthrus_rag.") for name in sys.modules):
        raise RuntimeError("orthrus_rag is already imported; --tree must be set before")
    sys.meta_path.insert(0, _TreeFinder(base))


def describe_tree(base: Path) -> str:
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(base), *args], capture_output=True, text=True, check=False)
        return out.stdout.rstrip() if out.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return f"{base} (not a git checkout)"
    dirty = [line[3:] for line in git("status", "--porcelain", "--", *PROJECT_ROOTS.values()).splitlines()]
    return f"{base} at {head}" + (f", {len(dirty)} project files changed: {', '.join(dirty)}" if dirty else ", clean")


# ---- the trips -------------------------------------------------------------------------------------------------
# Where each builder the CLI calls lives: today's module first, then where it lived in older releases, so the
# script measures a checkout of either layout (`--tree`).
BUILDERS = {
    "register_configs": ("orthrus_rag.config.app", "orthrus_rag.app_config"),
    "validate": ("orthrus_rag.entrypoints.checks", "orthrus_rag.app_config"),
    "build_client": ("orthrus_rag.entrypoints.clients",),
    "build_app": ("orthrus_rag.entrypoints.openai.api",),
    "resolve_api_key": ("orthrus_rag.entrypoints.openai.server",),
    "load_examples": ("orthrus_rag.entrypoints.commands",),
    "build_retriever": ("orthrus_rag.entrypoints.commands",),
    "build_pipeline": ("orthrus_rag.entrypoints.commands",),
    "run_labels": ("orthrus_rag.entrypoints.commands",),
    "RunSession": ("orthrus_rag.entrypoints.run_session",),
}


def builder(name: str) -> Any:
    """The project's own `name` (a function the CLI calls), from the first module of BUILDERS[name] that has it."""
    import importlib

    for module in BUILDERS[name]:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise  # NOTE: the module exists but something it imports does not: a real failure
            continue
        if found is not None:
            return found
    raise ImportError(f"{name} is in none of {', '.join(BUILDERS[name])}")


def compose(overrides: list[str]) -> Any:
    """The config `orthrus-rag run|serve` composes (Hydra, the package's conf/ and the registered schema)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    builder("register_configs")()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def _server_app(cfg: Any) -> Any:
    """What `orthrus-rag serve` (deploy=engine) serves: `build_app(build_client(cfg), ...)`."""
    builder("validate")(cfg)
    s = cfg.serve
    client = builder("build_client")(cfg)
    return builder("build_app")(client, s.served_model_name, builder("resolve_api_key")(s.api_key),
                                s.default_max_tokens)


def _post(http: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{path} answered {response.status_code}: {response.text[:500]}")
    return response.json()


def server_trips(tracer: TripTracer, overrides: list[str], trips: list[str]) -> list[Trip]:
    """`chat` / `embedding` (/ `embedding-adapter`) against one server: each warmed up, then measured."""
    from fastapi.testclient import TestClient

    app = _server_app(compose(overrides))
    service = app.state.service
    chat_model, embedding_model = service.models.generation, next(iter(service.models.embedding), None)

    def chat(http: Any, text: str) -> Callable[[], Any]:
        body = {"model": chat_model, "max_tokens": 4, "temperature": 0.0,
                "messages": [{"role": "user", "content": text}]}
        return lambda: _post(http, "/v1/chat/completions", body)

    def embed(http: Any, text: str) -> Callable[[], Any]:
        return lambda: _post(http, "/v1/embeddings", {"model": embedding_model, "input": text})

    out = []
    with traced(tracer), TestClient(app) as http:
        for trip in trips:
            if trip == "chat":
                chat(http, "What is the capital of France?")()  # the warm-up
                out.append(measure(tracer, trip, chat(http, "Who wrote the novel Pride and Prejudice?")))
            else:
                embed(http, "Red, yellow and blue are called primary colours.")()  # the warm-up
                out.append(measure(tracer, trip, embed(http, "Jane Austen published Pride and Prejudice in 1813.")))
            logger.info("%s: %d files, %d climbs", trip, out[-1].files, out[-1].climbs)
    return out


def iter_retgen_trip(tracer: TripTracer, data: Path) -> Trip:
    """One 2Wiki question through Iter-RetGen as `orthrus-rag run dataset=2wiki` builds it (commands.run /
    _run_session's steps), question 0 as the warm-up, question 1 measured."""
    validate, build_client, load_examples, build_retriever, build_pipeline, run_labels, RunSession = (
        builder(name) for name in ("validate", "build_client", "load_examples", "build_retriever", "build_pipeline",
                                   "run_labels", "RunSession"))
    with tempfile.TemporaryDirectory(prefix="trips-") as tmp:
        cfg = compose(["dataset=2wiki", f"dataset.path={data}", "dataset.limit=2", "pipeline.max_tokens=8",
                       "pipeline.max_concurrency=1", "progress=false", f"run_dir={tmp}/run"])
        validate(cfg)
        session = RunSession(cfg.run_dir, cfg)
        examples = load_examples(cfg)
        warm, measured = session.remaining(examples)[:2]
        client = build_client(cfg)
        retriever = build_retriever(cfg, client, examples, session.folder / "index")
        pipeline = build_pipeline(cfg, client, retriever)
        session.labels = run_labels(cfg, client, pipeline.max_concurrency)
        stop_observing = client.observe_steps(session.observe)
        session.begin()
        result: list[Trip] = []

        async def answer() -> None:
            try:
                async def one(item: Any) -> None:
                    async with contextlib.aclosing(pipeline.stream([item])) as records:
                        async for rec in records:
                            session.record(rec)

                await one(warm)
                with tracer.window():
                    await one(measured)
                    await asyncio.sleep(SETTLE_S)
                result.append(tracer.result("iter-retgen"))
            finally:
                if stop_observing is not None:
                    stop_observing()
                await client.aclose()

        try:
            with traced(tracer):
                asyncio.run(answer())
        finally:
            session.close()
        failed = [r for r in session.store.read_records() if r.error]
        if failed:
            raise RuntimeError(f"a question failed: {failed[0].error}")
    logger.info("iter-retgen: %d files, %d climbs", result[0].files, result[0].climbs)
    return result[0]


def run_trips(names: list[str], base: Path, data: Path | None) -> list[Trip]:
    tree = ProjectTree(base)
    floor_of = tree.floors()
    trips: list[Trip] = []
    default_server = [t for t in ("chat", "embedding") if t in names]
    if default_server:
        trips += server_trips(TripTracer(tree, floor_of), [], default_server)
    if "embedding-adapter" in names:
        trips += server_trips(TripTracer(tree, floor_of), ["model=smollm2_backbone"], ["embedding-adapter"])
    if "iter-retgen" in names:
        trips.append(iter_retgen_trip(TripTracer(tree, floor_of), data))
    return trips


# ---- output -----------------------------------------------------------------------------------------------------
def table(trips: list[Trip]) -> str:
    lines = [f"{'trip':<18} {'files':>5} {'target':>6} {'climbs':>6} {'target':>6}"]
    for t in trips:
        lines.append(f"{t.trip:<18} {t.files:>5} {'<=' + str(TARGETS.get(t.trip, '-')):>6} {t.climbs:>6} "
                     f"{'<=' + str(MAX_CLIMBS):>6}")
    for t in trips:
        lines.append(f"\n{t.trip}: {t.files} files (floor file)")
        by_floor = sorted(t.file_list, key=lambda f, t=t: (-t.floors.get(f, -1), f))
        lines += [f"  {t.floors.get(f, -1):>3} {f}" for f in by_floor]
        lines.append(f"{t.trip}: {t.climbs} climbs back up (floor caller -> floor callee)")
        lines += [f"  {t.floors[a]:>3} {a} -> {t.floors[b]:>3} {b}" for a, b in t.climb_list]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Trip]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trip", choices=[*TRIPS, "all"], default="all")
    parser.add_argument("--data", type=Path, default=None,
                        help="the 2WikiMultihopQA dev JSONL the iter-retgen trip asks its question from (needed there)")
    parser.add_argument("--tree", type=Path, default=None,
                        help="measure this checkout's orthrus_rag instead of the installed one (default: this repo)")
    args = parser.parse_args(argv)
    if args.data is None and args.trip in ("all", "iter-retgen"):
        parser.error("the iter-retgen trip asks a 2WikiMultihopQA question: give --data dev.jsonl")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    base = (args.tree or REPO).resolve()
    if args.tree is not None:
        use_tree(base)
    import orthrus_rag

    if not Path(orthrus_rag.__file__).resolve().is_relative_to(base):
        raise SystemExit(f"orthrus_rag imports from {orthrus_rag.__file__}, not from {base}")
    logger.info("measuring %s", describe_tree(base))
    trips = run_trips(list(TRIPS) if args.trip == "all" else [args.trip], base,
                      args.data.resolve() if args.data is not None else None)
    for t in trips:
        print(json.dumps(t.as_json()), flush=True)
    print(table(trips), flush=True)
    return trips


if __name__ == "__main__":
    main()
