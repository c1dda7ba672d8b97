"""Fuzzing the request schema against the real server: bodies drawn around the pydantic models (valid values,
wrong types, out-of-range numbers, NaN, junk fields) never get a 5xx, and every 4xx carries an OpenAI error body.
Bounded: a few dozen examples per endpoint, tiny generations."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                 st.text(max_size=8), st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                                 st.integers(), max_size=2))
SMALL_TEXT = st.text(max_size=40)
TOKEN_IDS = st.lists(st.integers(-3, 60_000), min_size=0, max_size=12)


def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(valid, valid, JUNK)


def _sampling() -> dict:
    return {
        "n": maybe(st.integers(-1, 3)),
        "temperature": maybe(st.one_of(st.floats(-1, 3), st.sampled_from([math.nan, math.inf, -math.inf]))),
        "top_p": maybe(st.one_of(st.floats(-0.5, 1.5), st.just(math.nan))),
        "stop": maybe(st.one_of(SMALL_TEXT, st.lists(SMALL_TEXT, max_size=5))),
        "seed": maybe(st.integers(-(2**64), 2**64)),
        "user": maybe(SMALL_TEXT),
        "logit_bias": maybe(st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2)),
        "stream": maybe(st.booleans()),
        "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": maybe(st.booleans())})),
    }


def _body(required: dict, optional: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries(required, optional=optional)


COMPLETION = _body({"model": maybe(st.sampled_from(["smollm2-135m-instruct", "nope", ""]))},
                   {"prompt": maybe(st.one_of(SMALL_TEXT, st.lists(SMALL_TEXT, max_size=3), TOKEN_IDS)),
                    "max_tokens": maybe(st.integers(-3, 3)), "logprobs": maybe(st.integers(-1, 6)),
                    "echo": maybe(st.booleans()), **_sampling()})
MESSAGE = st.fixed_dictionaries({"role": maybe(st.sampled_from(["system", "user", "assistant", "tool", "x"])),
                                 "content": maybe(st.one_of(SMALL_TEXT, st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": SMALL_TEXT}),
                                     max_size=2)))})
CHAT = _body({"model": maybe(st.sampled_from(["smollm2-135m-instruct", "nope"]))},
             {"messages": maybe(st.lists(MESSAGE, max_size=3)), "max_tokens": maybe(st.integers(-3, 3)),
              "max_completion_tokens": maybe(st.integers(-3, 3)), "logprobs": maybe(st.booleans()),
              "top_logprobs": maybe(st.integers(-1, 21)), "tools": maybe(st.lists(JUNK, max_size=1)),
              **_sampling()})
EMBEDDING = _body({"model": maybe(st.sampled_from(["all-minilm-l6-v2", "nope"]))},
                  {"input": maybe(st.one_of(SMALL_TEXT, st.lists(SMALL_TEXT, max_size=4), TOKEN_IDS,
                                            st.lists(TOKEN_IDS, max_size=2))),
                   "encoding_format": maybe(st.sampled_from(["float", "base64", "int8"])),
                   "dimensions": maybe(st.integers(-1, 400))})

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def _check(served, path: str, body: dict) -> None:
    # NOTE: allow_nan: NaN and Infinity go out as the bare words Python's JSON writes, as a careless client would
    raw = json.dumps(body, allow_nan=True).encode()
    with httpx.stream("POST", f"{served.url}/{path}", content=raw, headers={"content-type": "application/json"},
                      timeout=120) as resp:
        text = resp.read().decode()
    assert resp.status_code < 500, f"{resp.status_code} for {body}: {text[:300]}"
    if resp.status_code >= 400:
        error = json.loads(text)["error"]
        assert error["message"] and error["type"]
    elif resp.headers["content-type"].startswith("text/event-stream"):
        _check_events(text, body)
    else:
        assert json.loads(text)["object"] in ("list", "text_completion", "chat.completion")


def _check_events(text: str, body: dict) -> None:
    """A stream: every event is JSON (a chunk, or an error naming its cause) and it ends with [DONE] or the error."""
    assert body.get("stream") is True
    data = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert data, text[:300]
    for item in data[:-1]:
        assert json.loads(item)["object"] in ("text_completion", "chat.completion.chunk")
    last = data[-1]
    if last != "[DONE]":
        assert json.loads(last)["error"]["message"]


@FUZZ
@given(body=COMPLETION)
def test_fuzz_completions(served, body):
    _check(served, "completions", body)


@FUZZ
@given(body=CHAT)
def test_fuzz_chat(served, body):
    _check(served, "chat/completions", body)


@FUZZ
@given(body=EMBEDDING)
def test_fuzz_embeddings(served, body):
    _check(served, "embeddings", body)


@pytest.fixture(autouse=True, scope="module")
def _leaves_the_engine_clean(served):
    yield
    import time

    bm = served.engine.block_manager
    deadline = time.monotonic() + 60
    while (served.aengine.num_in_flight or bm.num_free_blocks != bm.num_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.aengine.num_in_flight == 0 and bm.num_free_blocks == bm.num_blocks
