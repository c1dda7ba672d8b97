"""Structured outputs through every other front end: the two-process deployments (dedicated, disagg-pd: the
constraint travels to the workers in the sampling parameters, and disagg-pd's decode worker rebuilds the matcher
from the handed-off tokens) and Ray Serve's replicas behind the OpenAI ingress. Each returns what one in-process
engine returns: a valid object, and one closed at max_tokens inside a string."""

from __future__ import annotations

import json

import openai
import pytest

from orthrus_rag import SamplingParams
from orthrus_rag.params import StructuredOutputsParams
from tests.conftest import SMOL
from tests.test_deployments import dedicated, disagg  # noqa: F401 (the module's deployments, as fixtures)
from tests.test_ray_serve import ray_serve  # noqa: F401 (a local Ray, two replicas)
from tests.test_structured_outputs import City, Portrait  # the schemas, one owner

pytestmark = pytest.mark.slow  # starts worker processes and Ray


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def test_deployments_return_what_the_engine_returns(engine, dedicated, disagg):  # noqa: F811
    tok = engine.tokenizer
    prompts = [_chat(tok, "Tell me about Rome as JSON."), _chat(tok, "Describe Paris as JSON with a long summary.")]
    params = [SamplingParams(max_tokens=48, temperature=0,
                             structured_outputs=StructuredOutputsParams(json=City.model_json_schema())),
              SamplingParams(max_tokens=24, temperature=0,  # cut inside the summary, closed
                             structured_outputs=StructuredOutputsParams(json=Portrait.model_json_schema()))]
    want = [engine.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    for dep in (dedicated, disagg):
        got = [dep.run([p], sp)[0][0] for p, sp in zip(prompts, params)]
        assert [o.token_ids for o in got] == [o.token_ids for o in want], type(dep).__name__
        City.model_validate_json(got[0].text)
        Portrait.model_validate_json(got[1].text)
        assert [o.finish_reason for o in got] == ["stop", "length"]


def test_ray_serve_replicas_hold_the_schema(ray_serve):  # noqa: F811
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
