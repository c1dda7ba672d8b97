"""The one engine loop: exactly one class steps the engine, and a step that raises fails every pending request of
every front end (the sync engine, the asyncio engine, the in-process load client, a deployment's worker) with the
cause, frees every block, and leaves the front end serving."""

from __future__ import annotations

import ast
import asyncio
import queue
import threading
from pathlib import Path

import pytest

from orthrus_rag import PoolingParams, SamplingParams
from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.engine.deploy.spec import WorkItem, dumps, loads
from orthrus_rag.engine.deploy.worker import _Worker
from orthrus_rag.engine.loop import EngineLoop, StepFailed
from orthrus_rag.engine.core.request import RequestKind

pytestmark = pytest.mark.slow  # builds on the shared engine (make test-fast skips it)

PACKAGE = Path(__file__).resolve().parents[1] / "orthrus_rag"
SP = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class Boom(RuntimeError):
    pass


@pytest.fixture
def failing_step(engine, monkeypatch):
    """The engine's next step raises `Boom` (after `arm()`); later steps run normally."""
    execute = engine.runner.execute
    state = {"armed": False, "raised": 0}

    def maybe_fail(sched):
        if state["armed"]:
            state["armed"] = False
            state["raised"] += 1
            raise Boom("injected")
        return execute(sched)

    monkeypatch.setattr(engine.runner, "execute", maybe_fail)
    state["arm"] = lambda: state.__setitem__("armed", True)
    return state


def _idle(engine) -> bool:
    return not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_only_the_engine_loop_calls_engine_step():
    callers = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        owners = {id(n): f"{path.relative_to(PACKAGE)}:{c.name}" for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                  for n in ast.walk(c)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step" \
                    and not node.args:
                callers.append(owners.get(id(node), str(path.relative_to(PACKAGE))))
    assert callers == ["engine/loop.py:EngineLoop"], callers  # once: EngineLoop.run_step


class _Recorder:
    def __init__(self) -> None:
        self.outputs, self.errors = [], []

    def put(self, output) -> None:
        self.outputs.append(output)

    def fail(self, exc) -> None:
        self.errors.append(exc)


def test_loop_fails_every_pending_request_with_the_cause(engine, failing_step):
    loop = EngineLoop(engine)
    sinks = [_Recorder() for _ in range(3)]
    loop.add(RequestKind.GENERATE, None, "Once upon a time", SP, sinks[0])
    loop.add(RequestKind.GENERATE, None, "The river", SP, sinks[1], stream=True)
    loop.add(RequestKind.EMBED, None, "a passage " * 200, PoolingParams(), sinks[2])
    loop.run_step()
    failing_step["arm"]()
    with pytest.raises(StepFailed) as exc:
        loop.run_step()
    assert isinstance(exc.value.__cause__, Boom)
    assert all(len(s.errors) == 1 and isinstance(s.errors[0], Boom) for s in sinks)
    assert _idle(engine) and not loop.sinks
    done = _Recorder()  # the loop serves on
    loop.add(RequestKind.GENERATE, None, "Hi", SamplingParams(max_tokens=2), done)
    loop.run_until_done(50)
    assert done.outputs[-1].finished and not done.errors


def test_sync_engine_run_raises_the_failure_and_keeps_nothing(engine, failing_step):
    failing_step["arm"]()
    with pytest.raises(StepFailed, match="injected"):  # the front end learns the step failed, and why
        engine.run(prompts=["Once upon a time"], sampling_params=SP, texts=["a passage"])
    assert _idle(engine)


def test_async_engine_fails_every_caller_and_serves_on(engine, failing_step):
    async def main():
        async with AsyncEngine(engine) as aeng:
            gen = asyncio.ensure_future(aeng.generate("Once upon a time", SP))
            emb = asyncio.ensure_future(aeng.embed("a passage " * 200))

            async def stream():
                async for _ in aeng.generate_stream("The river", SP):
                    pass
            streamed = asyncio.ensure_future(stream())
            while engine.num_steps == start or not engine.has_unfinished():
                await asyncio.sleep(0.005)
            failing_step["arm"]()
            results = await asyncio.gather(gen, emb, streamed, return_exceptions=True)
            after = await aeng.generate("Hi", SamplingParams(max_tokens=2))
            return results, after, aeng.num_in_flight

    start = engine.num_steps
    results, after, pending = asyncio.run(main())
    assert all(isinstance(r, Boom) for r in results), results
    assert after.finished and pending == 0 and _idle(engine)


def test_worker_sends_error_outputs_and_serves_on(engine, failing_step):
    inbox, results = queue.Queue(), queue.Queue()
    worker = _Worker(engine, "generate", inbox, results, None)
    thread = threading.Thread(target=worker.serve, daemon=True)
    items = [WorkItem(0, "w0", "generate", "Once upon a time", SP), WorkItem(1, "w1", "embed", "a passage " * 200,
                                                                           PoolingParams())]
    failing_step["arm"]()
    inbox.put(dumps(("submit", 7, items)))
    thread.start()
    got = {}
    while len(got) < 2:
        tag, role, batch, payload = loads(results.get(timeout=60))
        if tag == "outputs":
            assert batch == 7
            got.update(payload)
    assert all(o.finish_reason == "error" for o in got.values())
    assert "injected" in got[0].text and "injected" in got[1].error
    inbox.put(dumps(("submit", 8, [WorkItem(0, "w2", "generate", "Hi", SamplingParams(max_tokens=2))])))
    while True:
        tag, role, batch, payload = loads(results.get(timeout=60))
        if tag == "outputs" and batch == 8:
            assert payload[0][1].finish_reason == "length"
            break
    inbox.put(dumps(("stop",)))
    thread.join(30)
    assert not thread.is_alive() and _idle(engine)
