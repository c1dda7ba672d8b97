"""Shared fixtures: each real model loads once per test session."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# NOTE: under pytest-xdist (`make test` runs two workers on two cores) each worker computes on one thread: two
# workers of two OpenMP threads each on two cores spin against each other; the servers and Ray actors that tests
# start inherit it through the environment
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # should a plugin have imported torch before OMP_NUM_THREADS was set
from hypothesis import settings  # noqa: E402

# NOTE: every run replays the same examples, locally and under CI (a red run must mean a change broke something,
# not a new draw); ORTHRUS_FUZZ_EXPLORE=1 draws new ones, to look for new failures on purpose
settings.register_profile("fixed", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("explore" if os.environ.get("ORTHRUS_FUZZ_EXPLORE") else "fixed")

FAST = os.environ.get("ORTHRUS_TEST_FAST") == "1"


class ModelLoadInFastRun(AssertionError):
    """A test of the fast subset built an engine or loaded weights: mark it `slow`."""


def pytest_configure(config: pytest.Config) -> None:
    """`make test-fast` (ORTHRUS_TEST_FAST=1, `-m "not slow and not gpu"`): the subset must stay model-free, so
    building an engine or resolving a model's weights fails the test that did it, naming the marker to add."""
    if not FAST:
        return
    from orthrus_rag.engine.engine import Engine
    from orthrus_rag.models import registry

    def refuse(*args: object, **kwargs: object) -> None:
        raise ModelLoadInFastRun("this test loads a model or builds an engine: mark it @pytest.mark.slow")

    Engine.__init__ = refuse  # type: ignore[method-assign]
    registry.resolve_model_path = refuse  # type: ignore[assignment]


# the shared fixtures that load a real model: a test that uses any of them (directly or through another fixture)
# is `slow`; modules that build engines on their own models carry `pytestmark = pytest.mark.slow`
MODEL_FIXTURES = {"smol_path", "smol_tokenizer", "hf_smol", "smol_engine", "engine", "served"}


# `make test` runs two workers (pytest-xdist, `--dist loadfile`: a module's tests stay on one worker, so its module
# fixtures are built once). Workers take modules in collection order: the longest ones go first, so that no long
# module starts last and runs alone; the Ray modules at the two ends, so that they rarely wait on each other's lock.
FIRST = ("test_ray_serve", "test_deployments", "test_langchain_standard", "test_structured_outputs", "test_resume",
         "test_method_resume", "test_engine_embed", "test_quantized", "test_readme_commands", "test_documents_api")
LAST = ("test_ray_index",)


def _module_rank(item: pytest.Item) -> int:
    name = item.path.stem
    return FIRST.index(name) - len(FIRST) if name in FIRST else 1 if name in LAST else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_module_rank)  # NOTE: stable: the order within a module is kept


@pytest.fixture(scope="module")
def one_ray_at_a_time(tmp_path_factory):
    """Held by a module that starts a local Ray for as long as it runs: each takes both CPUs, and two workers' Ray
    clusters would share them (a file lock beside the workers' temporary folders, which they share)."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    lock = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "ray.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


SMOL = "smollm2-135m-instruct"
MINILM = "all-minilm-l6-v2"


def engine_overrides(**kw: object) -> dict:
    """Small-cache defaults for tests (the default 1 GiB cache is for real use), in fp32: the parity tests compare
    against fp32 references whatever the CPU ("auto" is bf16 where it has bf16 dot products; the bf16 set is
    tests/test_bf16_cpu.py)."""
    base = {"num_blocks": 512, "max_num_batched_tokens": 64, "max_chunk_tokens": 32, "max_num_seqs": 32,
            "dtype": "float32"}
    base.update(kw)
    return base


@pytest.fixture(scope="session")
def smol_path():
    from orthrus_rag.models.registry import resolve_model_path

    return resolve_model_path(SMOL)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_path))


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_engine():
    from orthrus_rag import Engine

    return Engine.from_pretrained(SMOL, **engine_overrides())


@pytest.fixture
def engine(smol_engine):
    """The shared engine, checked to be idle and leak-free after each test."""
    yield smol_engine
    assert not smol_engine.has_unfinished()
    assert smol_engine.block_manager.num_free_blocks == smol_engine.block_manager.num_blocks


SERVED_MAX_IN_FLIGHT = 8  # small, so the queue-full (429) path is reachable with a handful of requests
SERVED_REFERENCE_TEXTS = ["Jane Austen wrote Pride and Prejudice.", "The Nile flows north into the Mediterranean."]


@pytest.fixture(scope="session")
def served():
    """One real server for the session: SmolLM2 + MiniLM behind `orthrus_rag.entrypoints.openai` on a free loopback port.
    `reference`: in-process embeddings of SERVED_REFERENCE_TEXTS from the same engine, taken before it served."""
    from types import SimpleNamespace

    from orthrus_rag import Engine
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.entrypoints.openai import ServerThread

    engine = Engine.from_pretrained(SMOL, embedding_model=MINILM, **engine_overrides())
    reference = [o.embedding.clone() for o in engine.embed(SERVED_REFERENCE_TEXTS)]
    aengine = AsyncEngine(engine, max_in_flight=SERVED_MAX_IN_FLIGHT)
    server = ServerThread(aengine, default_max_tokens=8)
    yield SimpleNamespace(engine=engine, aengine=aengine, server=server, url=server.url, reference=reference,
                          model=SMOL, embedding_model=MINILM)
    server.stop()


@pytest.fixture(scope="module")
def local(served):
    """A second engine on the served engine's weights (the server is idle meanwhile), behind one LocalOrthrus: the
    in-process LangChain components of a module share it."""
    from orthrus_rag import Engine
    from orthrus_rag.integrations.langchain import LocalOrthrus

    src = served.engine
    engine = Engine(src.config, src.runner.model, src.tokenizer, encoder=src.runner.encoder,
                    encoder_tokenizer=src.inputs.encoder_tokenizer, encoder_pooling=src.encoder_pooling)
    shared = LocalOrthrus.of(engine)
    yield shared
    shared.close()
    assert not engine.scheduler.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@contextlib.contextmanager
def embed_priorities(engine):
    """The priority of every embedding request `engine` takes meanwhile, as (input, priority) in arrival order: what
    the scheduler ranks it by (> 0: bulk work). Wraps `Engine.add_embed`, where every front end's embeddings enter."""
    seen: list[tuple[object, int]] = []
    add, own = engine.add_embed, "add_embed" in vars(engine)

    def recording(text, params=None, request_id=None):
        seen.append((text, params.priority if params is not None else 0))  # NOTE: a list append is thread-safe
        return add(text, params, request_id)

    engine.add_embed = recording
    try:
        yield seen
    finally:
        if own:
            engine.add_embed = add
        else:
            del engine.add_embed  # the class's method again
