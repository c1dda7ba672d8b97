"""Engine replicas on Ray Serve: a local Ray (2 CPUs), two replicas of one thread each behind the OpenAI ingress;
mixed chat (streamed too) and embedding traffic through the official client, both replicas carrying requests,
greedy answers equal to the single-process server's, structured outputs held by the replicas; and `orthrus-rag run
deploy=ray` through deployment handles with the local run's scores."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import openai
import pytest

from orthrus_rag.params import PoolingParams, SamplingParams
from tests.conftest import MINILM, SMOL, engine_overrides
from tests.test_structured_outputs import City, Portrait  # the schemas, one owner

pytestmark = pytest.mark.slow  # starts Ray and two engines


@pytest.fixture(scope="module", autouse=True)
def _own_ray(one_ray_at_a_time):
    """The module's Ray is the only one on the machine while it runs (tests/conftest.py)."""


PROMPTS = ["Name a colour.", "Who wrote Hamlet?", "Count to three.", "What is the capital of Italy?"]


@pytest.fixture(scope="module")
def ray_serve():
    import ray
    from ray import serve

    from orthrus_rag.config.build import engine_config
    from orthrus_rag.entrypoints.openai.server import free_port
    from orthrus_rag.entrypoints.ray.app import APP_NAME, REPLICA, build_application, start

    config = engine_config(SMOL, embedding_model=MINILM, num_threads=1, rerankers=["backbone"], **engine_overrides())
    app = build_application(config, replicas=2, cpus_per_replica=1, max_in_flight=64, default_max_tokens=8)
    url = start(app, port=free_port(), num_cpus=2)
    handle = serve.get_deployment_handle(REPLICA, app_name=APP_NAME)
    yield url, handle
    serve.shutdown()
    ray.shutdown()


def _chat(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        return client.chat.completions.create(model=SMOL, messages=messages, max_tokens=8,
                                              temperature=0).choices[0].message.content
    chunks = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=8, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_mixed_traffic_through_one_endpoint_equals_the_single_process_server(ray_serve, served):
    url, _ = ray_serve
    ours = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    single = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=120)
    # the replicas also load the backbone reranker (its card is listed); the single server loads none
    assert {m.id for m in ours.models.list()} == {m.id for m in single.models.list()} | {"backbone"}
    texts = [f"passage {i} about topic {i % 3}" for i in range(12)]
    with ThreadPoolExecutor(8) as pool:  # chat, streamed chat and embeddings in flight together
        chats = [pool.submit(_chat, ours, p) for p in PROMPTS]
        streams = [pool.submit(_chat, ours, p, True) for p in PROMPTS]
        embeds = [pool.submit(ours.embeddings.create, model=MINILM, input=texts[i::3]) for i in range(3)]
        got_chat, got_stream = [f.result() for f in chats], [f.result() for f in streams]
        got_embed = [f.result() for f in embeds]
    want = [_chat(single, p) for p in PROMPTS]
    assert got_chat == want and got_stream == want
    want_embed = single.embeddings.create(model=MINILM, input=texts[0::3])
    np.testing.assert_allclose([d.embedding for d in got_embed[0].data], [d.embedding for d in want_embed.data],
                               atol=1e-5)


def test_rerank_through_the_replicas_scores_as_one_engine(ray_serve, smol_engine):
    """POST /v1/rerank on the Ray ingress: each call scored by one replica's engine, as an in-process engine
    scores it."""
    import httpx

    from orthrus_rag import Engine
    from orthrus_rag.params import RerankParams
    from tests.test_rerank import DOCS, QUERY

    url, _ = ray_serve
    src = smol_engine
    local = Engine(replace(src.config, model=replace(src.config.model, rerankers=["backbone"])), src.runner.model,
                   src.tokenizer)
    want = local.score(QUERY, DOCS, RerankParams())
    with ThreadPoolExecutor(4) as pool:  # NOTE: several calls at once, so both replicas may take one
        replies = list(pool.map(lambda _: httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCS},
                                                     timeout=120), range(4)))
    for r in replies:
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert [got[i] for i in range(len(DOCS))] == pytest.approx(want, abs=1e-3)
    assert not local.has_unfinished()


def test_health_and_metrics_cover_every_replica(ray_serve):
    import time

    import httpx

    url, _ = ray_serve
    base = url.removesuffix("/v1")
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{base}/health", timeout=10).json())["replicas_up"] < 2:
        assert time.monotonic() < deadline, health
        time.sleep(0.5)
    assert health == {"status": "ok", "replicas_up": 2, "replicas_expected": 2, "degraded": False}
    text = httpx.get(f"{base}/metrics", timeout=10).text
    labelled = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("orthrus_kv_blocks_total{")}
    assert len(labelled) == 2  # each replica's KV figures, labelled by replica
    assert text.count("# TYPE orthrus_kv_blocks_total gauge") == 1  # one family, several replicas
    assert any(line.startswith("orthrus_requests_total{") and 'replica="' not in line for line in text.splitlines())


def test_both_replicas_carry_requests(ray_serve):
    _, handle = ray_serve

    async def many():
        gens = [handle.generate.remote(f"Count to {i}.", SamplingParams(max_tokens=8, temperature=0))
                for i in range(12)]
        embs = [handle.embed.remote(f"text {i}", PoolingParams()) for i in range(12)]
        return await asyncio.gather(*gens, *embs)

    # NOTE: Ray Serve's router picks between replicas by their queue lengths at random; under a loaded machine one
    # burst of 24 can land on one replica, so up to three bursts may be sent (a router that never spreads fails all)
    replicas: set[str] = set()
    for _ in range(3):
        replicas |= {o.request_id.split("/")[0] for o in asyncio.run(many())}
        if len(replicas) == 2:
            break
    assert len(replicas) == 2, f"every request went to {replicas}"


def test_replicas_hold_a_json_schema(ray_serve):
    """A valid object, and one closed at max_tokens inside a string (cut there when the closing is switched off)."""
    url, _ = ray_serve
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}}
    resp = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Tell me about Rome."}],
                                          max_tokens=48, temperature=0, response_format=fmt)
    City.model_validate_json(resp.choices[0].message.content)
    fmt = {"type": "json_schema", "json_schema": {"name": "portrait", "schema": Portrait.model_json_schema()}}
    ask = [{"role": "user", "content": "Describe Paris as JSON with a long summary."}]
    closed = client.chat.completions.create(model=SMOL, messages=ask, max_tokens=24, temperature=0,
                                            response_format=fmt).choices[0]
    assert closed.finish_reason == "length"
    Portrait.model_validate_json(closed.message.content)
    cut = client.chat.completions.create(model=SMOL, messages=ask, max_tokens=24, temperature=0, response_format=fmt,
                                         extra_body={"structured_close_on_length": False}).choices[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.message.content)


def test_a_killed_replica_fails_nothing_silently(ray_serve):
    """One replica's actor killed mid-load: every request is answered within a bounded time (none of them
    streams, so each that the dead replica held is sent again to the other one: only a stream that had already
    sent text may end in a retryable 503, RayServeClient), Ray brings the replica back, and neither replica holds a
    KV block afterwards."""
    import time

    import ray
    from ray import serve

    from orthrus_rag.entrypoints.ray.app import APP_NAME, REPLICA

    url, handle = ray_serve
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=90)

    def one(i: int) -> str:
        try:
            client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": f"Tell a story {i}."}],
                                           max_tokens=48, temperature=0)
            return "ok"
        except openai.InternalServerError as exc:  # NOTE: named in the assertion below, not raised in a worker
            return f"{exc.status_code}: {exc.message}"

    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True) if REPLICA in a["name"])
    start = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        time.sleep(1.0)
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)
        results = [f.result(timeout=120) for f in futures]
    # NOTE: a 503 here means a call whose replica died was not sent again (the client's retry, deploy.retries)
    assert results == ["ok"] * len(results), [r for r in results if r != "ok"]
    assert time.monotonic() - start < 120
    deadline = time.monotonic() + 120
    while serve.status().applications[APP_NAME].deployments[REPLICA].replica_states.get("RUNNING", 0) != 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1)
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + 60  # NOTE: the handle's router learns of the new replica a little after Serve
    while len(seen) < 2 and time.monotonic() < deadline:
        kv = handle.kv_blocks.remote().result()
        seen[kv["replica"]] = kv
        if len(seen) < 2:
            time.sleep(0.2)
    assert len(seen) == 2
    assert all(kv["free"] == kv["total"] and not kv["unfinished"] for kv in seen.values()), seen
    assert _chat(client, PROMPTS[0])  # and the endpoint serves again
    import httpx

    deadline = time.monotonic() + 30  # the new replica publishes its figures too
    while httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()["replicas_up"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_run_deploy_ray_scores_as_the_local_run(ray_serve, tmp_path):
    """`orthrus-rag run deploy=ray` drives Iter-RetGen through the replicas' handle (it replaces the HTTP app),
    reranking each retrieval's 4 candidates to 2 there: the same passages, reranker scores and answers as the
    local run."""
    from orthrus_rag.entrypoints import commands as app
    from tests.test_app_config import _compose

    common = ["experiment=smoke", "dataset.num_questions=4", "pipeline.max_tokens=16", "retriever.k=4",
              "pipeline.top_k=2", "model.rerankers=[backbone]", "pipeline.reranker=default",
              "progress=false", "cache.num_blocks=512", "scheduler.max_num_batched_tokens=64",
              "scheduler.max_chunk_tokens=32", "scheduler.max_num_seqs=32", "model.dtype=float32"]
    local = app.run(_compose(*common, f"run_dir={tmp_path / 'local'}"))
    remote = app.run(_compose(*common, "deploy=ray", "deploy.replicas=2", f"run_dir={tmp_path / 'ray'}"))
    assert remote["num_failed"] == 0 and remote["config"]["serving"] == "ray-serve"
    assert (remote["em"], remote["f1"]) == (local["em"], local["f1"])

    def kept(folder: str) -> dict[str, list[list[tuple[str, float]]]]:
        records = [json.loads(line) for line in (tmp_path / folder / "records.jsonl").read_text().splitlines()]
        return {r["id"]: [[(p["id"], p["score"]) for p in it["retrieved"]] for it in r["iterations"] if it["retrieved"]]
                for r in records}

    here, there = kept("local"), kept("ray")
    assert here.keys() == there.keys() and all(len(hop) == 2 for hops in there.values() for hop in hops)
    for qid, hops in here.items():
        assert [[i for i, _ in hop] for hop in there[qid]] == [[i for i, _ in hop] for hop in hops]
        assert [s for hop in there[qid] for _, s in hop] == pytest.approx([s for hop in hops for _, s in hop], abs=1e-4)


def _victim():
    import ray

    from orthrus_rag.entrypoints.ray.app import REPLICA

    found = next(a for a in ray.util.list_named_actors(all_namespaces=True) if REPLICA in a["name"])
    return ray.get_actor(found["name"], namespace=found["namespace"])


def test_a_run_whose_replica_is_killed_resumes_to_a_complete_set(ray_serve, tmp_path):
    """With no retries (`deploy.retries=0`), the questions a killed replica held are recorded as failed and
    retryable; the run goes on with the other replica, and a resume asks them again: every question answered."""
    import json
    import threading
    import time

    import ray

    from orthrus_rag.entrypoints import commands as app
    from tests.test_app_config import _compose

    for attempt in range(3):  # NOTE: a kill that lands after the victim's last question fails nothing: run again
        folder = tmp_path / f"run{attempt}"
        args = ["experiment=smoke", "dataset.num_questions=8", "pipeline.max_tokens=24", "retriever.k=2",
                "progress=false", "cache.num_blocks=512", "scheduler.max_num_batched_tokens=64", "deploy=ray",
                "deploy.replicas=2", "deploy.retries=0", "model.dtype=float32", f"run_dir={folder}"]
        first: dict = {}
        runner = threading.Thread(target=lambda: first.update(app.run(_compose(*args))))
        runner.start()
        deadline = time.monotonic() + 300
        while not (folder / "records.jsonl").is_file() or not (folder / "records.jsonl").read_bytes().count(b"\n"):
            assert runner.is_alive() and time.monotonic() < deadline, "the run recorded nothing"
            time.sleep(0.05)
        ray.kill(_victim(), no_restart=False)  # NOTE: mid-run: the other questions are in flight on both replicas
        runner.join(timeout=300)
        assert not runner.is_alive() and first["num_questions"] == 8
        failed = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
        failed = [r for r in failed if r["error"] is not None]
        if failed:
            break
    assert failed and all(r["error"].startswith("EngineUnavailable") and r["retryable"] for r in failed)
    assert first["num_failed"] == len(failed) and not first["failures"].keys() - {"EngineUnavailable"}

    resumed = app.run(_compose(*args, f"resume={folder}"))
    assert resumed["complete"] and resumed["num_questions"] == 8 and resumed["num_failed"] == 0
    records = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in records) == list(range(8))
    retried = [json.loads(line)["index"] for line in (folder / "retried.jsonl").read_text().splitlines()]
    assert sorted(retried) == sorted(r["index"] for r in failed)
    assert {r["index"] for r in records if r["session"] == 1} == set(retried)


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(ray_serve):
    """`deploy.min_replicas=1 max_replicas=2`: one replica at rest, a second one while more requests are in flight
    than `target_ongoing_requests`, back to one when the load has gone (delays shortened from Ray's defaults)."""
    import threading
    import time

    from ray import serve

    from orthrus_rag.entrypoints.ray.app import APP_NAME, REPLICA, _replica_options, ray_client, replica_deployment
    from tests.test_app_config import _compose

    cfg = _compose("deploy=ray", "deploy.min_replicas=1", "deploy.max_replicas=2", "deploy.replicas=1",
                   "deploy.target_ongoing_requests=1", "deploy.upscale_delay_s=0", "deploy.downscale_delay_s=1",
                   "cache.num_blocks=512", "model.dtype=float32")
    options = _replica_options(cfg)  # what `replicas_of(cfg)` deploys
    assert options["autoscaling"] == {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                                      "target_ongoing_requests": 1, "upscale_delay_s": 0, "downscale_delay_s": 1}
    # NOTE: two of Ray's own knobs shortened too: the handle pushes its in-flight count every metrics_interval_s
    # (10 s by default) and the autoscaler averages it over look_back_period_s (30 s), so the way back to one replica
    # waited ~30 s for the busy samples to age out
    fast = {**options["autoscaling"], "metrics_interval_s": 0.5, "look_back_period_s": 2}
    client = ray_client(replica_deployment(**{**options, "autoscaling": fast}))

    def running() -> int:
        return serve.status().applications[APP_NAME].deployments[REPLICA].replica_states.get("RUNNING", 0)

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 120
        while running() != count:
            assert time.monotonic() < deadline, f"still {running()} replicas, expected {count}"
            time.sleep(0.5)

    stop = threading.Event()

    def keep_busy() -> None:  # one generation after another; 8 of these keep 8 in flight
        while not stop.is_set():
            client.handle.generate.remote("Tell a long story.", SamplingParams(max_tokens=32)).result()

    try:
        assert running() == 1
        with ThreadPoolExecutor(8) as pool:
            busy = [pool.submit(keep_busy) for _ in range(8)]
            try:
                wait_for(2)
            finally:
                stop.set()
            for f in busy:
                f.result(timeout=120)
        wait_for(1)
    finally:
        asyncio.run(client.aclose())
