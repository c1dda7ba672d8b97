"""Structured outputs through the OpenAI server (response_format, vLLM's extra fields, streaming, 400s that name
the field) and through LangChain (`ChatOrthrus.with_structured_output`, in process and over HTTP)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema  # NOTE: in the dev install (ray[serve] needs it)
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from orthrus_rag.integrations.langchain import ChatOrthrus

pytestmark = pytest.mark.slow  # the session's server (SmolLM2 + MiniLM)


class City(BaseModel):
    """A city and its country."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema(),
                                                       "strict": True}}
ASK = [{"role": "user", "content": "Tell me about Paris as JSON."}]
FRUIT = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 16},
                                          "colour": {"enum": ["red", "green", "yellow"]},
                                          "sweet": {"type": "boolean"}},
         "required": ["fruit", "colour", "sweet"], "additionalProperties": False}
PORTRAIT = {"type": "object", "properties": {
    "city": {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
             "required": ["name", "country"], "additionalProperties": False},
    "summary": {"type": "string"}}, "required": ["city", "summary"], "additionalProperties": False}
# a list that never ends on its own: a model that likes listing runs into max_tokens inside it
COLOURS = ('start: "Colours: " colour (", " colour)* "."\n'
           'colour: "red" | "green" | "blue" | "yellow" | "black" | "white"')


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=120)


def _bad(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body


# ---- the server -------------------------------------------------------------------------------------------------
def test_json_schema_response_format(client, served):
    resp = client.chat.completions.create(model=served.model, messages=ASK, max_tokens=96, temperature=0,
                                          response_format=CITY_FORMAT)
    City.model_validate_json(resp.choices[0].message.content)
    assert resp.choices[0].finish_reason == "stop"
    # streamed: the deltas add up to the same valid object
    stream = client.chat.completions.create(model=served.model, messages=ASK, max_tokens=96, temperature=0,
                                            response_format=CITY_FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == resp.choices[0].message.content


def test_json_object_and_vllm_extra_fields(client, served):
    short = [{"role": "user", "content": 'Reply with a JSON object like {"name": "..."} naming a fruit.'}]
    resp = client.chat.completions.create(model=served.model, messages=short, max_tokens=64, temperature=0,
                                          response_format={"type": "json_object"})
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    yes_no = [{"role": "user", "content": "Is Paris in France?"}]
    resp = client.chat.completions.create(model=served.model, messages=yes_no, max_tokens=8, temperature=0,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert resp.choices[0].message.content in ("yes", "no")
    resp = client.chat.completions.create(model=served.model, messages=yes_no, max_tokens=8, temperature=0,
                                          extra_body={"guided_choice": ["oui", "non"]})
    assert resp.choices[0].message.content in ("oui", "non")
    resp = client.completions.create(model=served.model, prompt="The capital of France is", max_tokens=12,
                                     temperature=0, extra_body={"guided_regex": r" [A-Z][a-z]+\."})
    assert re.fullmatch(r" [A-Z][a-z]+\.", resp.choices[0].text)
    # n samples of one constrained request all follow it
    resp = client.chat.completions.create(model=served.model, messages=yes_no, max_tokens=8, n=3, seed=1,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert all(c.message.content in ("yes", "no", "maybe") for c in resp.choices)


def test_guided_json_and_guided_grammar(client, served):
    """vLLM's older fields, each holding an output the model alone does not write."""
    ask = [{"role": "user", "content": "Name a fruit and say whether it is sweet."}]
    free = client.chat.completions.create(model=served.model, messages=ask, max_tokens=48, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)
    resp = client.chat.completions.create(model=served.model, messages=ask, max_tokens=48, temperature=0,
                                          extra_body={"guided_json": FRUIT})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), FRUIT)
    # the schema as JSON text, on completions
    resp = client.completions.create(model=served.model, prompt="A fruit as JSON:", max_tokens=48, temperature=0,
                                     extra_body={"guided_json": json.dumps(FRUIT)})
    jsonschema.validate(json.loads(resp.choices[0].text), FRUIT)
    flags = [{"role": "user", "content": "List some colours of flags."}]
    resp = client.chat.completions.create(model=served.model, messages=flags, max_tokens=16, temperature=0,
                                          extra_body={"guided_grammar": COLOURS})
    text = resp.choices[0].message.content
    assert re.fullmatch(r"Colours: (red|green|blue|yellow|black|white)(, (red|green|blue|yellow|black|white))*\.",
                        text), text
    assert not free.choices[0].message.content.startswith("Colours: ")


def test_close_on_length_over_http(client, served):
    """At max_tokens inside a string the object comes back closed, finish_reason "length"; the extra field
    `structured_close_on_length: false` (or `close_on_length` in `structured_outputs`) gives the cut text back."""
    ask = [{"role": "user", "content": "Describe Paris as JSON with a long summary."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "portrait", "schema": PORTRAIT}}

    def chat(**kw):
        return client.chat.completions.create(model=served.model, messages=ask, max_tokens=24, temperature=0,
                                              **kw).choices[0]

    closed = chat(response_format=fmt)
    assert closed.finish_reason == "length"
    jsonschema.validate(json.loads(closed.message.content), PORTRAIT)
    for cut in (chat(response_format=fmt, extra_body={"structured_close_on_length": False}),
                chat(extra_body={"structured_outputs": {"json": PORTRAIT, "close_on_length": False}})):
        assert cut.finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(cut.message.content)
    body = _bad(lambda: chat(response_format=fmt, extra_body={"structured_close_on_length": "no"}))
    assert body["param"] == "structured_close_on_length"
    body = _bad(lambda: chat(extra_body={"structured_outputs": {"json": PORTRAIT, "close_on_length": "no"}}))
    assert body["param"] == "structured_outputs" and "close_on_length must be true or false" in body["message"]


def test_bad_constraints_are_400s_naming_the_field(client, served):
    def chat(**kw):
        return lambda: client.chat.completions.create(model=served.model, messages=ASK, max_tokens=8, **kw)

    body = _bad(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}))
    assert body["param"] == "response_format" and "invalid JSON schema" in body["message"]
    assert "frobnicate" in body["message"]
    body = _bad(chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert body["param"] == "response_format" and "json_schema.schema" in body["message"]
    body = _bad(chat(response_format={"type": "yaml"}))
    assert "'yaml'" in body["message"]
    body = _bad(chat(extra_body={"structured_outputs": {"regex": "(unclosed"}}))
    assert body["param"] == "structured_outputs" and "invalid regex" in body["message"]
    body = _bad(chat(extra_body={"structured_outputs": {"regexp": "a"}}))
    assert "unknown field(s) regexp" in body["message"]
    body = _bad(chat(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}))
    assert "one output constraint" in body["message"] and body["param"] == "guided_regex"
    body = _bad(chat(extra_body={"guided_choice": []}))
    assert body["param"] == "guided_choice"
    # streamed: the error is the status of the response, not a broken stream
    with pytest.raises(openai.BadRequestError):
        chat(stream=True, extra_body={"guided_regex": "(unclosed"})()
    # nothing was submitted, nothing leaked
    assert served.aengine.num_in_flight == 0


# ---- LangChain --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["in_process", "http"])
def test_with_structured_output(where, local, served):
    chat = (ChatOrthrus(engine=local, max_tokens=96, temperature=0) if where == "in_process"
            else ChatOrthrus(base_url=served.url, max_tokens=96, temperature=0))
    city = chat.with_structured_output(City).invoke("Tell me about Rome as JSON.")
    assert isinstance(city, City) and city.name
    chunks = list(chat.with_structured_output(City).stream("Tell me about Rome as JSON."))
    assert chunks and all(isinstance(c, City) for c in chunks) and chunks[-1] == city
    as_dict = chat.with_structured_output(City.model_json_schema()).invoke("Tell me about Rome as JSON.")
    assert as_dict == city.model_dump()
    raw = asyncio.run(chat.with_structured_output(City, include_raw=True).ainvoke("Tell me about Rome as JSON."))
    assert raw["parsed"] == city and raw["parsing_error"] is None and raw["raw"].content
    # json_mode constrains to some JSON object only: the small model may not write a City (nor finish in budget),
    # and include_raw reports that instead of raising
    mode = chat.with_structured_output(City, method="json_mode", include_raw=True).invoke(
        "Tell me about Rome as JSON.")
    assert mode["raw"].content.startswith("{")
    assert (mode["parsed"] is None) == (mode["parsing_error"] is not None)


def test_with_structured_output_refuses_what_it_cannot_do(local):
    chat = ChatOrthrus(engine=local)
    with pytest.raises(ValueError, match="method 'xml' is not supported"):
        chat.with_structured_output(City, method="xml")
    with pytest.raises(ValueError, match="unexpected arguments tools"):
        chat.with_structured_output(City, tools=[])
