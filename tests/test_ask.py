"""`orthrus-rag ask`: a question from the shell over an index of one's own documents, with any method; the
generation streams, each search's passages are numbered, the answer and its sources close it; without a question,
a prompt reads them until end of input; bad input exits 2 naming it."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from orthrus_rag.entrypoints.ask import StreamingClient, show_answer, show_step
from orthrus_rag.entrypoints.cli import _question, main
from orthrus_rag.pipelines.records import IterationRecord, QARecord

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["progress=false", "cache.kv_cache_gib=0.05", "scheduler.max_num_batched_tokens=256"]


def test_the_question_is_the_first_argument_that_is_not_an_override() -> None:
    assert _question(["Who wrote Emma?", "retriever.index_dir=x"]) == ("Who wrote Emma?", ["retriever.index_dir=x"])
    assert _question(["pipeline=ircot", "what is 2+2=4?", "+x=1"]) == ("what is 2+2=4?", ["pipeline=ircot", "+x=1"])
    assert _question(["retriever.index_dir=x", "--cfg", "job"]) == (None, ["retriever.index_dir=x", "--cfg", "job"])
    assert _question(["--cfg", "job", "Why?"]) == ("Why?", ["--cfg", "job"])
    assert _question(["retriever.index_dir=x"]) == (None, ["retriever.index_dir=x"])


class _Streams:
    """A client whose streams grow one word at a time, a stop-string hold-back included."""

    async def generate_stream(self, prompt, params=None, request_id=None):
        for text, done in (("Mars", False), ("Mars is", False), ("Mars is", False), ("Mars is red.", True)):
            await asyncio.sleep(0)
            yield SimpleNamespace(text=text, finished=done, token_ids=[1] * len(text.split()))

    async def continue_stream(self, request_id, appended=(), params=None):
        yield SimpleNamespace(text="ok", finished=True, token_ids=[1])

    max_in_flight = 7


def test_generations_stream_their_text_and_the_steps_are_cited() -> None:
    written: list[str] = []
    client = StreamingClient(_Streams(), written.append)
    out = asyncio.run(client.generate("p"))
    assert written == ["Mars", " is", " red.", "\n"] and out.text == "Mars is red." and client.max_in_flight == 7
    assert callable(client.continue_) and asyncio.run(client.continue_("r", "x")).text == "ok"
    assert not hasattr(StreamingClient(SimpleNamespace(), print), "continue_")  # re-submits where it cannot
    buf = io.StringIO()
    show_step(IterationRecord(1, "red planet", [{"id": "m", "title": "Mars", "score": 0.91},
                                                {"id": "v", "title": "", "score": 0.5}], "", "", "", 0, 0), buf)
    rec = QARecord("q", "?", [], None, [], iterations=[IterationRecord(
        1, "red planet", [{"id": "m", "title": "Mars", "score": 0.9}], "", "", "Mars", 0, 0)], prediction="Mars")
    show_answer(rec, buf)
    assert buf.getvalue() == ("  [search] red planet\n    [1] Mars  (0.910)\n    [2] v  (0.500)\n"
                              "answer: Mars\nsources: [1] Mars\n")


def test_ask_without_an_index_exits_2_naming_it(capsys: pytest.CaptureFixture) -> None:
    assert main(["ask", "Who wrote Emma?", *SMALL]) == 2
    assert "retriever.index_dir" in capsys.readouterr().err


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ask_index")
    assert main(["index", "corpus=jsonl", f"corpus.path={ROOT / 'examples' / 'corpus.jsonl'}", f"run_dir={run_dir}",
                 *SMALL]) == 0
    return run_dir / "index"


@pytest.mark.slow
def test_ask_answers_one_question_streamed_and_cited(index_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ask", "Who designed the bridge in the capital of Astrel?", f"retriever.index_dir={index_dir}",
                 "pipeline=search_r1", "pipeline.constrain_format=true", "pipeline.min_searches=1",
                 "pipeline.max_searches=1", "pipeline.step_tokens=32", "retriever.k=2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.startswith("<think>")  # the first round's text, streamed before its search
    assert out.count("[search]") == 1 and "    [1] " in out and "    [2] " in out
    assert "\nanswer: " in out and "\nsources: [1] " in out
    assert "INFO" not in out  # the log is on stderr


@pytest.mark.slow
def test_ask_without_a_question_reads_them_until_exit(index_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    too_long = "why " * 5000  # more than the embedder and the KV cache take: that question fails, the prompt goes on
    monkeypatch.setattr("sys.stdin", io.StringIO("Where was the first rector of the University of Veloria born?\n"
                                                 f"\n{too_long}\nIn which city was the author of The Glass Orchard "
                                                 "born?\nexit\nnever asked\n"))
    assert main(["ask", f"retriever.index_dir={index_dir}", "pipeline=standard_rag", "pipeline.max_tokens=12",
                 "retriever.k=2", *SMALL]) == 1  # one question failed
    out = capsys.readouterr().out
    assert out.count("question> ") == 5 and out.count("\nanswer: ") == 2 and out.count("[search]") == 2
    assert out.count("failed: ValueError") == 1
