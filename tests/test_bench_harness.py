"""The benchmark harness measures what a client serves: drivers count completions per kind within the window,
keep at most C in flight, submit open-loop requests on schedule, and reports come out of the results; the
in-process client serves real requests through one engine."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

from orthrus_rag.engine.clients import InProcessClient, ServingClient
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput
from orthrus_rag.params import PoolingParams, SamplingParams
from scripts.bench.driver import closed_loop, open_loop, summarize
from scripts.bench.report import markdown_table, plot_latency_cdf, plot_step_mix, plot_throughput, write_json
from scripts.bench.workloads import Workload, fcfs_blocking, mixed_stream, poisson, three_phase

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)


class FakeClient:
    """Finishes an embedding after 2 polls and a generation after 4; tracks the most requests in flight."""

    def __init__(self) -> None:
        self.inflight: dict[str, list] = {}
        self.max_inflight = 0
        self.step_log: list = []

    def submit(self, kind: str, request_id: str, input: str | Sequence[int], params: object) -> None:
        self.inflight[request_id] = [kind, 2 if kind == "embed" else 4]
        self.max_inflight = max(self.max_inflight, len(self.inflight))

    def poll(self, timeout_s: float) -> list:
        time.sleep(0.002)
        out = []
        for rid, entry in list(self.inflight.items()):
            entry[1] -= 1
            if entry[1] == 0:
                del self.inflight[rid]
                out.append(EmbeddingOutput(rid, [], None) if entry[0] == "embed"  # type: ignore[arg-type]
                           else GenerationOutput(rid, [], [1, 2], "ab", "length"))
        return out

    def shutdown(self) -> None:
        pass


def test_fake_client_is_a_serving_client():
    client: ServingClient = FakeClient()
    assert callable(client.poll)


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


def test_closed_loop_counts_per_kind_and_bounds_concurrency():
    client = FakeClient()
    res = closed_loop(client, mixed_stream(0.5, Workload(seed=1)), concurrency=4, max_requests=40)
    assert client.max_inflight == 4 and len(res.records) == 40 and not client.inflight
    s = summarize(res)
    kinds = s["kinds"]
    assert kinds["embed"]["completed"] + kinds["generate"]["completed"] == 40 and s["unfinished"] == 0
    assert kinds["generate"]["p50_s"] > kinds["embed"]["p50_s"] > 0  # 4 polls vs 2
    timed = closed_loop(FakeClient(), mixed_stream(0.5, Workload()), concurrency=2, duration_s=0.2)
    assert timed.window_s == 0.2 and summarize(timed)["kinds"]["embed"]["throughput_rps"] > 0


def test_open_loop_submits_on_schedule():
    reqs = poisson(200.0, 30, 0.5, Workload(seed=2))
    res = open_loop(FakeClient(), reqs)
    assert all(r.finish_s is not None and r.finish_s >= r.start_s for r in res.records)
    assert [r.start_s for r in res.records] == [r.arrival_s for r in reqs]


def test_report_writes_table_json_and_plots(tmp_path):
    rows, runs = [], {}
    for group in ("9:1", "1:9"):
        runs[group] = {}
        for system in ("orthrus", "dedicated"):
            res = closed_loop(FakeClient(), mixed_stream(0.5, Workload()), concurrency=3, max_requests=12)
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


def test_in_process_client_serves_both_kinds(engine, one_thread):
    client = InProcessClient(engine)
    gen = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(2):
        client.submit("generate", f"g{i}", f"Count to three, take {i}:", gen)
        client.submit("embed", f"e{i}", f"a short passage number {i}", PoolingParams())
    with pytest.raises(ValueError):
        client.submit("classify", "x", "hi", None)  # type: ignore[arg-type]
    outs: dict = {}
    for _ in range(50):
        outs.update((o.request_id, o) for o in client.poll(0.01))
        if len(outs) == 4:
            break
    assert sorted(outs) == ["e0", "e1", "g0", "g1"]
    assert all(len(outs[f"g{i}"].token_ids) == 3 for i in range(2))
    assert all(outs[f"e{i}"].embedding.ndim == 1 for i in range(2))
    assert client.step_log and client.poll(0.0) == []  # idle: nothing to step
    res = closed_loop(client, mixed_stream(0.5, Workload(words=4, max_tokens=2)), concurrency=2, max_requests=4)
    assert summarize(res)["unfinished"] == 0 and len(res.steps) > 0


def test_peer_requests_carry_instruction_truncation_and_vectors_back():
    from scripts.bench.peer_client import PeerClient

    class FakePeer:
        def __init__(self) -> None:
            self.sent: list[tuple] = []

        def submit(self, kind, rid, text, fields):  # noqa: ANN001
            self.sent.append((kind, rid, text, fields))

        def poll(self, timeout_s):  # noqa: ANN001
            return [{"request_id": "e0", "kind": "embed", "n_tokens": 3, "embedding": [0.6, 0.8]},
                    {"request_id": "g0", "kind": "generate", "n_tokens": 2, "text": "Paris"},
                    {"request_id": "g1", "kind": "generate", "n_tokens": 0, "error": "ValueError: too long"}]

        def shutdown(self) -> None:
            pass

    peer = FakePeer()
    client = PeerClient(peer, return_embeddings=True)
    client.submit("embed", "e0", "capital of France", PoolingParams(instruction="query: ", truncate=True))
    client.submit("generate", "g0", "Q:", SamplingParams(max_tokens=4, temperature=0.0))
    assert peer.sent[0] == ("embed", "e0", "query: capital of France", {"truncate": True, "return_embedding": True})
    assert peer.sent[1][3] == {"max_tokens": 4, "temperature": 0.0, "ignore_eos": False}
    emb, gen, bad = client.poll(0.0)
    assert torch.equal(emb.embedding, torch.tensor([0.6, 0.8])) and emb.error is None
    assert (gen.text, len(gen.token_ids), gen.finish_reason) == ("Paris", 2, "length")
    assert bad.finish_reason == "error" and "too long" in bad.text
    with pytest.raises(TypeError, match="text inputs only"):
        client.submit("embed", "e1", [1, 2, 3], None)
    # the load drivers only count requests: no vectors are asked for
    PeerClient(peer).submit("embed", "e2", "text", None)
    assert peer.sent[-1][3] == {}
