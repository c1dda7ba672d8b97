"""The OpenAI-compatible server, started for real on a free loopback port and driven with the official `openai`
client (and raw httpx where a client would refuse to send the malformed request)."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import SERVED_MAX_IN_FLIGHT, SERVED_REFERENCE_TEXTS

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

CHAT = [{"role": "user", "content": "Name three colours."}]
# greedy, SmolLM2 writes all 400 tokens for this one (it stops after ~120 for "Count from 1 to 500.")
LONG = [{"role": "user", "content": "Write the numbers from 1 to 300, separated by commas."}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=120)


def _wait_idle(served, timeout_s: float = 60.0) -> None:
    """Every request gone from the engine and every KV block free, within `timeout_s`."""
    bm = served.engine.block_manager
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if served.aengine.num_in_flight == 0 and not served.engine.scheduler.requests and bm.num_free_blocks == bm.num_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle after {timeout_s} s: {served.aengine.num_in_flight} pending, "
                         f"{len(served.engine.scheduler.requests)} in the engine, {bm.num_free_blocks}/{bm.num_blocks} free")


def test_models_and_health(served, client):
    ids = [m.id for m in client.models.list()]
    assert ids == [served.model, served.embedding_model]
    assert httpx.get(served.url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_http_embeddings_equal_in_process_ones_in_both_encodings(served, client):
    as_float = client.embeddings.create(model=served.embedding_model, input=SERVED_REFERENCE_TEXTS,
                                        encoding_format="float")
    raw = httpx.post(f"{served.url}/embeddings", json={"model": served.embedding_model,
                                                      "input": SERVED_REFERENCE_TEXTS, "encoding_format": "base64"})
    assert raw.status_code == 200
    for item, b64, want in zip(as_float.data, raw.json()["data"], served.reference):
        got = np.asarray(item.embedding, dtype=np.float32)
        decoded = np.frombuffer(base64.b64decode(b64["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(got, decoded)  # float and base64 carry the same float32 values
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens > 0


def test_completions_n_and_seed(served, client):
    kw = dict(model=served.model, prompt="The capital of France is", max_tokens=4, temperature=1.0, seed=7, n=3)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # same seed, same samples
    assert len({c.text for c in first.choices}) > 1  # the n samples differ (seed + index)
    assert first.usage.completion_tokens <= 12 and first.usage.prompt_tokens > 0
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)


def test_chat_stop_and_max_completion_tokens(served, client):
    greedy = client.chat.completions.create(model=served.model, messages=CHAT, max_completion_tokens=6,
                                            temperature=0)
    text = greedy.choices[0].message.content
    assert greedy.usage.completion_tokens <= 6 and text
    assert greedy.choices[0].message.role == "assistant"
    stop = text.split()[1] if len(text.split()) > 1 else text[-1]
    stopped = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=6, temperature=0,
                                             stop=[stop])
    assert stop not in stopped.choices[0].message.content  # OpenAI: the stop sequence is not returned
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_takes_flashrags_flare_request(served, client):
    """FlashRAG's FLARE over an OpenAI-compatible server: 22 one-character stops (OpenAI and vLLM take 4) and
    logprobs=True; the scores it reads are the content logprobs. Past the bound, a 400 names it."""
    stops = list("!@#$%^&*()\n\n)(*&^%$#@!")
    out = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=6, temperature=0,
                                         stop=stops, logprobs=True)
    choice = out.choices[0]
    assert not any(s in choice.message.content for s in stops)
    assert len(choice.logprobs.content) == out.usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError, match="stop sequences"):
        client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=2,
                                       stop=[f"s{i}" for i in range(65)])


def test_streaming_chat_equals_the_whole_answer(served, client):
    kw = dict(model=served.model, messages=CHAT, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_streaming_n_greater_than_one(served, client):
    chunks = list(client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=4, n=2, seed=3,
                                                 temperature=1.0, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_chat_logprobs_are_the_greedy_choice(served, client):
    out = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=3, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 2
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-4)  # greedy took the best


def test_completion_logprobs(served, client):
    out = client.completions.create(model=served.model, prompt="One, two, three,", max_tokens=3, temperature=0,
                                    logprobs=1)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)


def _decoded_since(served, step: int) -> tuple[int, int]:
    """(steps run since engine step `step`, decode tokens they carried)."""
    steps = [s for s in served.engine.step_stats if s.step >= step]
    return len(steps), sum(s.num_decode_tokens for s in steps)


def _count(served, kind: str, status: str) -> float:
    registry = served.server.app.state.metrics.registry
    return registry.get_sample_value("orthrus_requests_total", {"kind": kind, "status": status}) or 0.0


def test_disconnecting_streaming_client_aborts_its_request(served):
    """The abort itself, not the request running out: greedy, LONG needs all 400 tokens (400 decode steps), so
    a request left running would decode far more than the few steps the disconnect takes to notice."""
    body = {"model": served.model, "messages": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
    first = served.engine.num_steps
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{served.url}/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(4):  # role chunk, then some content: the request is decoding
            next(line for line in lines if line.startswith("data:"))
        assert served.engine.block_manager.num_free_blocks < served.engine.block_manager.num_blocks
    left = served.engine.num_steps
    _wait_idle(served, timeout_s=30)
    steps_after, _ = _decoded_since(served, left)
    _, decoded = _decoded_since(served, first)
    assert steps_after < 100 and decoded < 200, (steps_after, decoded)


def test_disconnecting_plain_client_aborts_its_request(served):
    body = {"model": served.model, "messages": LONG, "max_tokens": 400, "temperature": 0}
    first, aborted = served.engine.num_steps, _count(served, "chat", "499")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/chat/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    left = served.engine.num_steps
    _wait_idle(served, timeout_s=30)
    steps_after, _ = _decoded_since(served, left)
    _, decoded = _decoded_since(served, first)
    # aborted, not finished: LONG decodes all 400 tokens when left running
    assert steps_after < 100 and decoded < 200, (steps_after, decoded)
    assert _count(served, "chat", "499") == aborted + 1  # answered as a client-closed request


def test_full_queue_answers_429_with_retry_after(served):
    """One streaming request with n = the queue's size fills it (its choices are submitted together); while they
    decode, any further request is a 429 with Retry-After, and nothing of it reaches the engine."""
    body = {"model": served.model, "messages": LONG, "max_tokens": 400, "temperature": 0, "n": SERVED_MAX_IN_FLIGHT,
            "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{served.url}/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():  # until the first content: every choice is in the engine
                if line.startswith("data:") and '"content":"' in line and '"content":""' not in line:
                    break
            assert served.aengine.num_in_flight == SERVED_MAX_IN_FLIGHT
            busy = http.post(f"{served.url}/embeddings", json={"model": served.embedding_model, "input": "x"})
            assert busy.status_code == 429
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "rate_limit_error"
            assert served.aengine.num_in_flight == SERVED_MAX_IN_FLIGHT
    _wait_idle(served)


@pytest.mark.parametrize("body,status,named", [
    (b'{"model": "m", "input": ', 400, "not valid JSON"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    (b'{"model": "smollm2-135m-instruct", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (b'{"model": "smollm2-135m-instruct", "prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    ({"model": "gpt-4o", "prompt": "hi"}, 404, "gpt-4o"),
    ({"model": "smollm2-135m-instruct", "prompt": [1] * 9000, "max_tokens": 1}, 400, "maximum"),
    ({"model": "smollm2-135m-instruct", "prompt": [], "max_tokens": 1}, 400, "prompt is empty"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "suffix": "!"}, 400, "suffix"),
    # strict types, as OpenAI: a number in a string is not a number, true is not a count
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 2.0}, 400, "max_tokens"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "n": "2"}, 400, "n"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "stream": "yes"}, 400, "stream"),
])
def test_bad_completion_requests_are_4xx_naming_the_problem(served, body, status, named):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    resp = httpx.post(f"{served.url}/completions", timeout=60, **kw)
    assert resp.status_code == status, resp.text
    assert named in resp.json()["error"]["message"]


@pytest.mark.parametrize("change,named", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "image_url content"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"response_format": {"type": "xml"}}, "xml"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"temperature": "0.5"}, "temperature"),
    ({"max_completion_tokens": False}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
])
def test_bad_chat_requests_are_400_naming_the_problem(served, change, named):
    body = {"model": served.model, "messages": CHAT, "max_tokens": 2, **change}
    resp = httpx.post(f"{served.url}/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert named in resp.json()["error"]["message"]


def test_bad_embedding_requests(served):
    url = f"{served.url}/embeddings"
    too_many = httpx.post(url, json={"model": served.embedding_model, "input": ["a"] * 2049})
    assert too_many.status_code == 400 and "at most 2048" in too_many.json()["error"]["message"]
    dims = httpx.post(url, json={"model": served.embedding_model, "input": "a", "dimensions": 10})
    assert dims.status_code == 400 and "dimensions" in dims.json()["error"]["message"]
    huge = httpx.post(url, content=b'{"input": "' + b"a" * (17 << 20) + b'"}',
                      headers={"content-type": "application/json"}, timeout=60)
    assert huge.status_code == 413
    typed = httpx.post(url, json={"model": served.embedding_model, "input": "a", "dimensions": "384"})
    assert typed.status_code == 400 and "dimensions" in typed.json()["error"]["message"]


def test_a_request_that_can_never_fit_is_400_naming_the_limit_not_429(served, client):
    """More inputs (or prompts x choices) than the server ever holds at once: waiting cannot help, so no
    retryable 429; the official client gets a BadRequestError at once, naming the limit."""
    limit = SERVED_MAX_IN_FLIGHT
    too_many = httpx.post(f"{served.url}/embeddings", json={"model": served.embedding_model, "input": ["a"] * (limit + 1)})
    assert too_many.status_code == 400 and "retry-after" not in too_many.headers
    assert f"at most {limit}" in too_many.json()["error"]["message"]
    retrying = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=3, timeout=60)
    with pytest.raises(openai.BadRequestError, match="deploy.max_in_flight"):
        retrying.completions.create(model=served.model, prompt=["a", "b", "c"], n=3, max_tokens=1)
    fits = client.embeddings.create(model=served.embedding_model, input=["a"] * limit)  # exactly the limit: served
    assert len(fits.data) == limit
    _wait_idle(served)


def test_models_retrieve(served, client):
    assert client.models.retrieve(served.model).id == served.model
    assert client.models.retrieve(served.embedding_model).id == served.embedding_model
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.models.retrieve("gpt-4o")


def test_refused_requests_are_counted_too(served):
    """Invalid JSON and schema violations never reach a route, but are answers all the same: counted by status."""
    before = _count(served, "completions", "400"), _count(served, "chat", "400")
    url = served.url
    assert httpx.post(f"{url}/completions", content=b"{", headers={"content-type": "application/json"}).status_code \
        == 400
    assert httpx.post(f"{url}/completions", json={"model": served.model, "prompt": "hi", "top_p": 7}).status_code == 400
    assert httpx.post(f"{url}/chat/completions", json={"model": served.model, "messages": []}).status_code == 400
    assert (_count(served, "completions", "400"), _count(served, "chat", "400")) == (before[0] + 2, before[1] + 1)


def _step_counts(served) -> dict[str, float]:
    """Observations of `orthrus_step_tokens` per kind (one per step that carried that kind)."""
    registry = served.server.app.state.metrics.registry
    return {kind: registry.get_sample_value("orthrus_step_tokens_count", {"kind": kind}) or 0.0
            for kind in ("embed", "prefill", "decode", "encoder")}


def test_step_tokens_count_only_the_kinds_a_step_carried(served, client):
    before = _step_counts(served)
    client.embeddings.create(model=served.embedding_model, input=["one text", "another"])
    after = _step_counts(served)
    assert after["encoder"] > before["encoder"]
    assert after["decode"] == before["decode"] and after["prefill"] == before["prefill"]  # no zeros recorded


def test_logprobs_come_from_the_sampling_step_not_a_second_request(served, client, monkeypatch):
    """No re-scoring pass: the chat is the only engine request, and no embedding row runs for it."""
    kinds: list[str] = []
    for name, kind in (("add_generate", "generate"), ("add_embed", "embed")):
        original = getattr(served.engine, name)
        monkeypatch.setattr(served.engine, name, lambda *a, _f=original, _k=kind, **kw: (kinds.append(_k), _f(*a, **kw))[1])
    before = _step_counts(served)
    out = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3)
    assert kinds == ["generate"]
    after = _step_counts(served)
    assert (after["embed"], after["encoder"]) == (before["embed"], before["encoder"])
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens


def test_bad_requests_leave_requests_in_flight_unharmed(served, client):
    kw = dict(model=served.model, messages=CHAT, max_tokens=8, temperature=0)
    want = client.chat.completions.create(**kw).choices[0].message.content
    result: dict = {}

    def _stream() -> None:
        chunks = client.chat.completions.create(**kw, stream=True)
        result["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    thread = threading.Thread(target=_stream)
    thread.start()
    codes = [httpx.post(f"{served.url}/chat/completions", content=raw,
                        headers={"content-type": "application/json"}).status_code
             for raw in (b"{", b'{"model": 1}', b'{"model": "smollm2-135m-instruct", "messages": [], "n": -1}',
                         json.dumps({**kw, "temperature": -1}).encode(),
                         json.dumps({**kw, "messages": [{"role": "user", "content": [1] * 10}]}).encode())]
    thread.join(120)
    assert all(400 <= c < 500 for c in codes), codes
    assert result["text"] == want
    _wait_idle(served)


def test_metrics_show_both_kinds_in_the_same_steps(served, client):
    """Embeddings and a generation from different clients at once: some engine step carried both. (At most 7
    requests at once: the session server's queue holds 8.)"""
    errors: list = []

    def _embed() -> None:
        try:
            for _ in range(3):
                client.embeddings.create(model=served.embedding_model, input=["a short text"] * 3)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=_embed) for _ in range(2)]
    for t in threads:
        t.start()
    client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=16, temperature=0)
    for t in threads:
        t.join(120)
    assert not errors
    text = httpx.get(served.url.removesuffix("/v1") + "/metrics").text
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert metrics["orthrus_mixed_steps_total"] >= 1
    assert 0 < metrics["orthrus_mixed_step_share"] <= 1
    assert metrics['orthrus_requests_total{kind="embeddings",status="ok"}'] >= 6
    assert metrics["orthrus_kv_blocks_total"] == served.engine.block_manager.num_blocks
    assert metrics['orthrus_e2e_latency_seconds_count{kind="embed"}'] >= 18
    assert metrics["orthrus_time_to_first_token_seconds_count"] >= 1
    assert metrics['orthrus_step_tokens_count{kind="encoder"}'] >= 1
    assert metrics["orthrus_inter_token_latency_seconds_count"] >= 1  # the generation's gaps, one per token
    assert metrics["orthrus_time_per_output_token_seconds_count"] >= 1
    assert metrics["orthrus_slo_time_capped_steps_total"] == 0  # no target set


def test_api_key(served, monkeypatch):
    from fastapi.testclient import TestClient

    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.entrypoints.openai import build_app
    from orthrus_rag.entrypoints.openai.server import resolve_api_key

    # NOTE: a second app over the same engine that never steps it (every request here stops before the engine)
    with TestClient(build_app(AsyncEngine(served.engine), api_key="sekret")) as http:
        assert http.get("/v1/models").status_code == 401
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert http.get("/health").status_code == 200
    assert len(served.engine.step_observers) == 1  # the second app's metrics unhooked themselves
    monkeypatch.setenv("ORTHRUS_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"
    monkeypatch.delenv("ORTHRUS_API_KEY")
    assert resolve_api_key(None) is None


@pytest.mark.parametrize("overrides,message", [
    (["serve.port=70000"], "serve.port must be in"),
    (["deploy=dedicated"], "serve runs one co-scheduled engine"),
    (["serve.default_max_tokens=0"], "serve.default_max_tokens must be at least 1"),
])
def test_serve_command_refuses_bad_config_before_loading(overrides, message, tmp_path, capsys, monkeypatch):
    from orthrus_rag.entrypoints.cli import main

    def no_model(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a model was loaded for a bad config")

    monkeypatch.setattr("orthrus_rag.engine.engine.Engine.from_config", no_model)
    assert main(["serve", *overrides, f"run_dir={tmp_path}"]) == 2  # the console script exits with it
    assert message in capsys.readouterr().err


def test_vllm_extra_sampling_fields_reach_the_engine(served, client):
    """What vLLM's clients and benchmarks send beside the OpenAI fields is honoured, not dropped: `ignore_eos` runs
    a reply that ends at EOS to max_tokens, `min_tokens` holds its EOS back, `stop_token_ids` ends it, `top_k=1`
    samples the greedy tokens at any temperature."""
    base = {"model": served.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40,
            "temperature": 0.0}
    free = client.chat.completions.create(**base)
    n = free.usage.completion_tokens
    assert free.choices[0].finish_reason == "stop" and n < 30, "the reply should end at EOS"
    through = client.chat.completions.create(**base, extra_body={"ignore_eos": True})
    assert through.usage.completion_tokens == 40 and through.choices[0].finish_reason == "length"
    held = client.chat.completions.create(**base, extra_body={"min_tokens": n + 3})
    assert held.usage.completion_tokens >= n + 3
    ids = served.engine.tokenizer(free.choices[0].message.content, add_special_tokens=False)["input_ids"]
    cut = client.chat.completions.create(**base, extra_body={"stop_token_ids": [ids[1]]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 2
    prompt = {"model": served.model, "prompt": "The weather today is", "max_tokens": 6}
    greedy = client.completions.create(**prompt, temperature=0.0)
    top1 = client.completions.create(**prompt, temperature=2.0, seed=7, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize("extra,named", [
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"min_p": 0.1}, "min_p"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
    ({"stop_token_ids": [-2]}, "stop_token_ids"),
])
def test_extra_fields_the_engine_cannot_honour_are_400_naming_them(served, extra, named):
    body = {"model": served.model, "prompt": "hi", "max_tokens": 4, **extra}
    resp = httpx.post(f"{served.url}/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert named in resp.json()["error"]["message"]


def test_unknown_fields_are_answered_with_a_header_naming_them(served):
    """A field no schema knows is let through (newer clients keep working) but named in `X-Ignored-Fields`; the
    neutral values of fields the engine cannot honour pass without it."""
    body = {"model": served.model, "prompt": "hi", "max_tokens": 2, "temperature": 0.0,
            "repetition_penalty": 1.0, "made_up_knob": 3, "another": True}
    plain = httpx.post(f"{served.url}/completions", json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    assert plain.headers["x-ignored-fields"] == "another, made_up_knob"
    streamed = httpx.post(f"{served.url}/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 200 and streamed.headers["x-ignored-fields"] == "another, made_up_knob"
    embedded = httpx.post(f"{served.url}/embeddings", json={"model": served.embedding_model, "input": "a",
                                                           "normalize": True}, timeout=60)
    assert embedded.status_code == 200 and embedded.headers["x-ignored-fields"] == "normalize"
    known = httpx.post(f"{served.url}/completions", json={"model": served.model, "prompt": "hi", "max_tokens": 2},
                       timeout=60)
    assert "x-ignored-fields" not in known.headers


def test_an_idle_kept_alive_connection_outlives_the_clients_pool_expiry(served):
    """The server keeps an idle connection open longer than httpx's pool does (5 s), so the client, not the server,
    is the side that closes it: a request on a reused connection never races the server's close. Past uvicorn's
    5-s default the same connection (same client port) still answers."""
    with httpx.Client(limits=httpx.Limits(keepalive_expiry=30.0), timeout=30) as http:
        def port() -> int:
            resp = http.get(f"{served.url}/models")
            assert resp.status_code == 200
            return resp.extensions["network_stream"].get_extra_info("client_addr")[1]

        first = port()
        time.sleep(5.6)
        assert port() == first


def test_prompt_logprobs_on_completions(served, client):
    """vLLM's `prompt_logprobs` on /v1/completions: per prompt token (None for the first) its log-probability,
    rank and decoded text under its id, beside the position's top tokens; the summed log-probabilities give the
    same perplexity for equal prompts. Chat refuses it by name."""
    prompt = "The capital of France is Paris. The capital of Italy is Rome."
    body = {"model": served.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 2}
    resp = httpx.post(f"{served.url}/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    scored = resp.json()["choices"][0]["prompt_logprobs"]
    ids = served.engine.tokenizer(prompt)["input_ids"]
    assert len(scored) == len(ids) and scored[0] is None
    for token_id, position in zip(ids[1:], scored[1:]):
        entry = position[str(token_id)]
        assert entry["logprob"] <= 0 and entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        assert 2 <= len(position) <= 3  # the prompt token and the two best (it may be one of them)
    again = httpx.post(f"{served.url}/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert again == scored
    chat = httpx.post(f"{served.url}/chat/completions", json={"model": served.model, "messages": CHAT,
                                                              "max_tokens": 2, "prompt_logprobs": 1}, timeout=60)
    assert chat.status_code == 400 and "prompt_logprobs" in chat.json()["error"]["message"]
