"""A question that failed for the serving system's reason (its replica died, the question timeout) is recorded as
retryable, and a resume asks it again (`retry_failed=retryable`, the default; `all`: every failed question;
`none`: keeps every record), keeping records.jsonl one record per question (the old records go to
retried.jsonl). Model-free: a fake engine and retriever."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from orthrus_rag.data import make_synthetic
from orthrus_rag.engine.clients.protocol import EngineUnavailable
from orthrus_rag.entrypoints.run_session import RunSession
from orthrus_rag.pipelines import IterRetGen
from orthrus_rag.pipelines.records import QARecord
from orthrus_rag.pipelines.run_store import RECORDS, RETRIED
from tests.test_app_config import _compose


class FailingEngine:
    """Fails the questions whose prompt names one of `fail` (by exception type), answers the others."""

    def __init__(self, fail: dict[str, BaseException]) -> None:
        self.fail = fail

    async def generate(self, prompt, params=None):
        await asyncio.sleep(0)
        for question, exc in self.fail.items():
            if question in prompt:
                raise exc
        return SimpleNamespace(text=" So the answer is Anna.")


def _records(examples, engine) -> list[QARecord]:
    async def go():
        pipe = IterRetGen(engine, None, iterations=1, max_concurrency=4)
        return [r async for r in pipe.stream(list(enumerate(examples)))]

    return sorted(asyncio.run(go()), key=lambda r: r.index)


def test_a_dead_replica_is_retryable_a_bad_input_is_not():
    examples = make_synthetic(num_questions=4)
    engine = FailingEngine({examples[1].question: EngineUnavailable("the replica serving this request failed"),
                            examples[2].question: ValueError("prompt too long")})
    recs = _records(examples, engine)
    assert [r.error is None for r in recs] == [True, False, False, True]
    assert recs[1].error.startswith("EngineUnavailable") and recs[1].retryable
    assert recs[2].error.startswith("ValueError") and not recs[2].retryable


def test_a_timed_out_question_is_retryable():
    class Slow:
        async def generate(self, prompt, params=None):
            await asyncio.sleep(30)

    async def go():
        pipe = IterRetGen(Slow(), None, iterations=1, question_timeout_s=0.05)
        return [r async for r in pipe.stream([(0, make_synthetic(num_questions=1)[0])])]

    (rec,) = asyncio.run(go())
    assert rec.error.startswith("TimeoutError") and rec.retryable


def _folder_with_failures(tmp_path):
    """A run folder of 4 questions: #1 failed retryably, #2 failed for its input."""
    examples = make_synthetic(num_questions=4)
    cfg = _compose("experiment=smoke", f"run_dir={tmp_path}", "progress=false")
    session = RunSession(tmp_path, cfg)
    session.remaining(examples)
    engine = FailingEngine({examples[1].question: EngineUnavailable("replica died"),
                            examples[2].question: ValueError("prompt too long")})
    for rec in _records(examples, engine):
        session.store.append_record(rec)
    session.close()
    return examples, cfg


def _resume(tmp_path, cfg, retry_failed: str) -> RunSession:
    cfg = OmegaConf.merge(cfg, {"resume": str(tmp_path), "retry_failed": retry_failed})
    return RunSession(tmp_path, cfg)


@pytest.mark.parametrize("retry_failed,asked", [("retryable", [1]), ("all", [1, 2]), ("none", [])])
def test_resume_asks_the_chosen_failed_questions_again(tmp_path, retry_failed, asked):
    examples, cfg = _folder_with_failures(tmp_path)
    session = _resume(tmp_path, cfg, retry_failed)
    assert [i for i, _ in session.remaining(examples)] == asked
    assert len((tmp_path / RECORDS).read_text().splitlines()) == 4  # moved only once the pipeline starts
    session.begin()
    session.store.append_record(QARecord("new", "q", [], None, [], index=asked[0] if asked else 0))
    kept = [json.loads(line) for line in (tmp_path / RECORDS).read_text().splitlines()]
    kept = [r for r in kept if r["id"] != "new"]
    assert sorted(r["index"] for r in kept) == sorted(set(range(4)) - set(asked))  # one record per question
    assert len(kept) + 1 == len((tmp_path / RECORDS).read_text().splitlines())  # appends reach the new file
    aside = (tmp_path / RETRIED).read_text().splitlines() if (tmp_path / RETRIED).exists() else []
    assert sorted(json.loads(line)["index"] for line in aside) == asked
    assert session.scores.num_failed == 2 - len(asked)
    assert session.session == 1
    session.close()


def test_a_session_number_is_never_reused(tmp_path):
    """A resume whose re-asked questions all fail again, then a resume that sets them aside and dies before
    recording anything: the next session's number is not the first resume's (its records are only in
    retried.jsonl now); the session that left no trace at all may be numbered again."""
    examples, cfg = _folder_with_failures(tmp_path)
    first = _resume(tmp_path, cfg, "retryable")  # session 1: question 1 fails again
    first.remaining(examples)
    first.begin()
    engine = FailingEngine({examples[1].question: EngineUnavailable("replica died")})
    asyncio.run(_consume(first, IterRetGen(engine, None, iterations=1).stream(first.remaining(examples))))
    first.store.checkpoint(first.summary())
    first.close()
    second = _resume(tmp_path, cfg, "retryable")  # session 2: sets question 1 aside, then dies
    second.remaining(examples)
    second.begin()
    second.close()
    assert second.session == 2 and "synthetic_1" not in (tmp_path / RECORDS).read_text()
    assert _resume(tmp_path, cfg, "retryable").session == 2

def test_the_retried_questions_complete_the_run(tmp_path):
    """Resumed with a healthy backend, the run ends with every question answered and no failure left."""
    examples, cfg = _folder_with_failures(tmp_path)
    session = _resume(tmp_path, cfg, "all")
    session.begin()
    pipe = IterRetGen(FailingEngine({}), None, iterations=1)
    asyncio.run(_consume(session, pipe.stream(session.remaining(examples))))
    summary = session.summary()
    session.close()
    assert summary["complete"] and summary["num_questions"] == 4 and summary["num_failed"] == 0
    lines = (tmp_path / RECORDS).read_text().splitlines()
    assert sorted(json.loads(line)["index"] for line in lines) == [0, 1, 2, 3]


def test_retry_failed_is_checked(tmp_path):
    from orthrus_rag.entrypoints.checks import validate

    with pytest.raises(ValueError, match="unknown retry_failed .some.; expected one of retryable, all, none"):
        validate(_compose("experiment=smoke", f"run_dir={tmp_path}", "retry_failed=some"))


async def _consume(session, records) -> None:  # noqa: ANN001 (what `orthrus-rag run` does with a pipeline's stream)
    with session.progress():
        async for rec in records:
            session.record(rec)
