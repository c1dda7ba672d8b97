"""The benchmark harness measures what a client serves: drivers count completions per kind within the window,
keep at most C in flight, send open-loop requests on schedule, and reports come out of the results; an in-process
engine serves real requests through them, its steps logged."""

from __future__ import annotations

import asyncio

import pytest
import torch

from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput
from orthrus_rag.params import PoolingParams, SamplingParams, StructuredOutputsParams
from scripts.bench.driver import closed_loop, open_loop, summarize
from scripts.bench.report import markdown_table, plot_latency_cdf, plot_step_mix, plot_throughput, write_json
from scripts.bench.workloads import (
    RequestSpec,
    Workload,
    fcfs_blocking,
    mixed_stream,
    poisson,
    rerank_stream,
    three_phase,
)

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # builds engines; tests the benchmark harness (make test-bench)


class FakeClient:
    """The driver's side of an `EngineClient`: an embedding takes 2 ticks and a generation 4 (a tick is 2 ms); a
    text starting with "fail" raises. Tracks the most requests in flight."""

    name, tokenizer = "fake", None

    def __init__(self) -> None:
        self.inflight: set[str] = set()
        self.max_inflight = 0

    def observe_steps(self, observer: object) -> None:
        return None

    async def _serve(self, rid: str, text: str, ticks: int, out: object) -> object:
        self.inflight.add(rid)
        self.max_inflight = max(self.max_inflight, len(self.inflight))
        try:
            await asyncio.sleep(0.002 * ticks)
            if text.startswith("fail"):
                raise RuntimeError(f"{rid} failed")
            return out
        finally:
            self.inflight.discard(rid)

    async def embed(self, text: str, params: object = None, request_id: str | None = None) -> object:
        return await self._serve(request_id, text, 2, EmbeddingOutput(request_id, [], None))  # type: ignore[arg-type]

    async def generate(self, prompt: str, params: object = None, request_id: str | None = None) -> object:
        return await self._serve(request_id, prompt, 4, GenerationOutput(request_id, [], [1, 2], "ab", "length"))

    async def score(self, query: str, documents: list[str], params: object = None) -> list[float]:
        """A rerank call: 1 tick per document; a query starting with "fail" raises."""
        await self._serve(f"s-{query}", query, len(documents), None)
        return [0.5] * len(documents)

    async def aclose(self) -> None:
        pass


def test_a_failed_request_is_recorded_and_the_run_goes_on():
    reqs = [RequestSpec("embed", "e0", "fail here", PoolingParams(), arrival_s=0.0),
            RequestSpec("generate", "g0", "fine", SamplingParams(), arrival_s=0.001)]
    res = asyncio.run(open_loop(FakeClient(), reqs))
    failed, ok = res.records
    assert failed.error == "RuntimeError: e0 failed" and failed.finish_s is not None
    assert ok.error is None and ok.num_output_tokens == 2
    assert summarize(res)["kinds"]["embed"]["errors"] == 1
    with pytest.raises(ValueError, match="'classify' is not a valid RequestKind"):
        asyncio.run(open_loop(FakeClient(), [RequestSpec("classify", "x", "hi", PoolingParams())]))


def test_what_is_unfinished_at_the_limit_is_cancelled_and_counted():
    client = FakeClient()
    slow = [RequestSpec("generate", f"g{i}", "x", SamplingParams(), arrival_s=0.0) for i in range(3)]
    res = asyncio.run(open_loop(client, slow, drain_timeout_s=0.003))  # a generation takes 8 ms
    assert summarize(res)["unfinished"] == 3 and not client.inflight  # cancelled, not left running


def test_workloads_are_deterministic_and_mixed():
    w = Workload(words=8, max_tokens=4, seed=3)
    a = [next(s) for s in [mixed_stream(0.3, w)] for _ in range(200)]
    b = [next(s) for s in [mixed_stream(0.3, w)] for _ in range(200)]
    assert [(r.kind, r.input) for r in a] == [(r.kind, r.input) for r in b]
    frac = sum(r.kind == "embed" for r in a) / len(a)
    assert 0.2 < frac < 0.4 and all(len(r.input.split()) == 8 for r in a)
    assert all(r.params.max_tokens == 4 for r in a if r.kind == "generate")
    burst = fcfs_blocking(3, 2, w, long_max_tokens=50)
    assert [r.kind for r in burst] == ["generate"] * 3 + ["embed"] * 2 and burst[0].params.max_tokens == 50
    phases = three_phase(100, w)
    assert [sum(r.kind == "embed" for r in p) for p in phases][0] < 30 < 70 < sum(r.kind == "embed" for r in phases[2])
    arrivals = [r.arrival_s for r in poisson(50.0, 100, 0.5, w)]
    assert arrivals == sorted(arrivals) and 1.0 < arrivals[-1] < 4.0


def test_rerank_calls_are_a_third_kind_in_the_stream_and_the_summary():
    w = Workload(words=8, max_tokens=4, seed=3)
    reqs = [next(s) for s in [rerank_stream(0.3, 0.2, w, documents=4)] for _ in range(300)]
    shares = {k: sum(r.kind == k for r in reqs) / len(reqs) for k in ("embed", "score", "generate")}
    assert 0.2 < shares["embed"] < 0.4 and 0.1 < shares["score"] < 0.3 and shares["generate"] > 0.4
    query, docs = next(r.input for r in reqs if r.kind == "score")
    assert len(docs) == 4 and len(query.split()) == 2 and all(len(d.split()) == 8 for d in docs)
    again = [next(s) for s in [rerank_stream(0.3, 0.2, w, documents=4)] for _ in range(300)]
    assert [r.input for r in again] == [r.input for r in reqs]
    with pytest.raises(ValueError, match="sum of at most 1"):
        next(rerank_stream(0.7, 0.5, w, documents=4))
    res = asyncio.run(closed_loop(FakeClient(), iter(reqs[:40]), concurrency=4))
    s = summarize(res)
    assert set(s["kinds"]) == {"embed", "generate", "score"} and s["unfinished"] == 0
    assert sum(k["completed"] for k in s["kinds"].values()) == 40 and s["kinds"]["score"]["completed"] > 0
    assert all(r.num_output_tokens == 4 for r in res.records if r.kind == "score")
    # a run without rerank calls keeps the two kinds its tables and plots show
    plain = asyncio.run(closed_loop(FakeClient(), mixed_stream(0.5, w), concurrency=2, max_requests=6))
    assert set(summarize(plain)["kinds"]) == {"embed", "generate"}


def test_closed_loop_counts_per_kind_and_bounds_concurrency():
    client = FakeClient()
    res = asyncio.run(closed_loop(client, mixed_stream(0.5, Workload(seed=1)), concurrency=4, max_requests=40))
    assert client.max_inflight == 4 and len(res.records) == 40 and not client.inflight
    s = summarize(res)
    kinds = s["kinds"]
    assert kinds["embed"]["completed"] + kinds["generate"]["completed"] == 40 and s["unfinished"] == 0
    assert kinds["generate"]["p50_s"] > kinds["embed"]["p50_s"] > 0  # 4 ticks vs 2
    timed = asyncio.run(closed_loop(FakeClient(), mixed_stream(0.5, Workload()), concurrency=2, duration_s=0.2))
    assert timed.window_s == 0.2 and summarize(timed)["kinds"]["embed"]["throughput_rps"] > 0


def test_open_loop_submits_on_schedule():
    reqs = poisson(200.0, 30, 0.5, Workload(seed=2))
    res = asyncio.run(open_loop(FakeClient(), reqs))
    assert all(r.finish_s is not None and r.finish_s >= r.start_s for r in res.records)
    assert [r.start_s for r in res.records] == [r.arrival_s for r in reqs]


def test_report_writes_table_json_and_plots(tmp_path):
    rows, runs = [], {}
    for group in ("9:1", "1:9"):
        runs[group] = {}
        for system in ("orthrus", "dedicated"):
            res = asyncio.run(closed_loop(FakeClient(), mixed_stream(0.5, Workload()), concurrency=3,
                                          max_requests=12))
            res.steps = [{"t": 0.1 * i, "embed": 8, "prefill": 4, "decode": 2, "encoder": 0, "step_time": 0.1}
                         for i in range(20)] if system == "orthrus" else []
            rows.append({"system": system, "group": group, **summarize(res)})
            runs[group][system] = res.to_dict()
    table = markdown_table(rows)
    assert "emb × dedicated" in table and "1.00×" in table and table.count("\n") == 2 + len(rows)
    write_json(tmp_path / "r.json", {"rows": rows, "runs": runs})
    paths = [plot_throughput(rows, tmp_path / "tp.png"), plot_latency_cdf(runs["9:1"], tmp_path / "cdf.png"),
             plot_step_mix(runs["9:1"], tmp_path / "mix.png")]
    assert all(p is not None and p.stat().st_size > 1000 for p in paths)


@pytest.fixture
def one_thread():
    """NOTE: 2 OpenMP threads on 2 cores that other processes also use can run ~50x slower; this test checks
    behaviour, not speed."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_an_in_process_engine_serves_the_drivers_and_its_steps_are_logged(engine, one_thread):
    async def main():
        client = AsyncEngine(engine)
        try:
            return await closed_loop(client, mixed_stream(0.5, Workload(words=4, max_tokens=3), prefix="m"),
                                     concurrency=2, max_requests=6)
        finally:
            await client.aclose()

    res = asyncio.run(main())
    assert summarize(res)["unfinished"] == 0 and all(r.error is None for r in res.records)
    kinds = {r.kind for r in res.records}
    assert kinds == {"embed", "generate"}, kinds
    assert all(r.num_output_tokens == 3 for r in res.records if r.kind == "generate")
    assert res.steps and sum(s["embed"] for s in res.steps) > 0 and sum(s["decode"] for s in res.steps) > 0


def test_peer_requests_carry_instruction_truncation_and_vectors_back():
    from scripts.bench.peer_client import PeerClient

    class FakePeer:
        def __init__(self) -> None:
            self.sent: list[tuple] = []

        def submit(self, kind, rid, text, fields):  # noqa: ANN001
            self.sent.append((kind, rid, text, fields))

        def poll(self, timeout_s):  # noqa: ANN001
            return [{"request_id": "e0", "kind": "embed", "n_tokens": 3, "embedding": [0.6, 0.8]},
                    {"request_id": "g0", "kind": "generate", "n_tokens": 2, "text": "Paris", "prompt_tokens": 40,
                     "cached_tokens": 32},
                    {"request_id": "g1", "kind": "generate", "n_tokens": 0, "error": "ValueError: too long"},
                    {"request_id": "g2", "kind": "generate", "n_tokens": 2, "text": "Rome.",
                     "token_ids": [11, 12], "logprobs": [[11, -0.1], [12, -2.5]]}]

        def shutdown(self) -> None:
            pass

    peer = FakePeer()
    client = PeerClient(peer, return_embeddings=True)
    client.submit("embed", "e0", "capital of France", PoolingParams(instruction="query: ", truncate=True))
    client.submit("generate", "g0", "Q:", SamplingParams(max_tokens=4, temperature=0.0))
    assert peer.sent[0] == ("embed", "e0", "query: capital of France", {"truncate": True, "return_embedding": True})
    assert peer.sent[1][3] == {"max_tokens": 4, "temperature": 0.0, "ignore_eos": False}
    # what the iterative methods ask: a sentence's stop string, and (FLARE) each token's logprob
    client.submit("generate", "g2", "Q:", SamplingParams(max_tokens=8, stop=["\n"], logprobs=0))
    assert peer.sent[2][3] == {"max_tokens": 8, "temperature": 1.0, "ignore_eos": False, "stop": ["\n"],
                               "logprobs": 0}
    # reasoning search: the stop string kept in the text, and its round's grammar (vLLM's structured outputs)
    client.submit("generate", "g3", "Q:", SamplingParams(max_tokens=8, stop=["</search>"],
                                                         include_stop_str_in_output=True,
                                                         structured_outputs=StructuredOutputsParams(regex="<a>[^<]*")))
    assert peer.sent[3][3]["include_stop_str_in_output"] and peer.sent[3][3]["structured_outputs"] == {
        "regex": "<a>[^<]*"}
    emb, gen, bad, flare = client.poll(0.0)
    assert flare.token_ids == [11, 12] and [(lp.token_id, lp.logprob) for lp in flare.logprobs] == [(11, -0.1),
                                                                                                   (12, -2.5)]
    assert gen.logprobs is None
    assert torch.equal(emb.embedding, torch.tensor([0.6, 0.8])) and emb.error is None
    assert (gen.text, len(gen.token_ids), gen.finish_reason) == ("Paris", 2, "length")
    assert (len(gen.prompt_token_ids), gen.num_cached_tokens) == (40, 32)  # prefill per question: 8 computed
    assert bad.finish_reason == "error" and "too long" in bad.text
    with pytest.raises(TypeError, match="text inputs only"):
        client.submit("embed", "e1", [1, 2, 3], None)
    # the load drivers only count requests: no vectors are asked for
    PeerClient(peer).submit("embed", "e2", "text", None)
    assert peer.sent[-1][3] == {}
