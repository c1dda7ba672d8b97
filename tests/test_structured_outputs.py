"""Structured outputs in the engine: constraints are checked, compiled once and applied as per-row token masks in
mixed steps; constrained outputs always parse, and unconstrained rows of the same steps are unchanged."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import threading
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from orthrus_rag import SamplingParams
from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.params import StructuredOutputsParams
from orthrus_rag.structured.bitmask import allocate_bitmask, allowed_tokens, apply_bitmask, constrain


class Evidence(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, else any extra key may follow
    title: str = Field(max_length=24)
    year: int = Field(ge=1000, le=2100)


class Finding(BaseModel):
    """The nested schema of the many-request test: a $ref'd object in an array, an enum, bounded strings."""

    model_config = ConfigDict(extra="forbid")
    answer: str = Field(max_length=24)
    confidence: Literal["low", "medium", "high"]
    evidence: list[Evidence] = Field(max_length=2)


class Town(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    country: str


class Portrait(BaseModel):
    """A nested object and an unbounded string: a model asked for a long summary runs into max_tokens inside it."""

    model_config = ConfigDict(extra="forbid")
    city: Town
    summary: str


class City(BaseModel):
    """Bounded strings: the model closes it well within its budget."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


FINDING = StructuredOutputsParams(json=Finding.model_json_schema())
# a Lark grammar whose language ends: after the "." it allows nothing, not even EOS
VERDICT = 'start: "The answer is " ("yes" | "no") "."'
# a recursive one: arithmetic with parentheses (each sentence is also a Python expression)
ARITHMETIC = """start: expr
expr: term ((" + " | " - " | " * ") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]?/
"""


# ---- the parameters -------------------------------------------------------------------------------------------
def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="must be an object"):
        StructuredOutputsParams(json="[1, 2]")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex="")
    spec = StructuredOutputsParams(json='{"type": "object"}')
    assert spec.json == {"type": "object"} and spec.kind == "json"
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    # the cache key ignores key order, and tells constraints apart
    assert StructuredOutputsParams(json={"a": 1, "b": 2}).key == StructuredOutputsParams(json={"b": 2, "a": 1}).key
    assert StructuredOutputsParams(regex="a").key != StructuredOutputsParams(grammar="a").key


def test_close_on_length_is_a_switch_not_part_of_the_grammar():
    on, off = StructuredOutputsParams(regex="a+"), StructuredOutputsParams(regex="a+", close_on_length=False)
    assert on.close_on_length and on.key == off.key  # one compiled grammar serves both
    assert "close_on_length" not in on.as_request() and off.as_request()["close_on_length"] is False
    assert StructuredOutputsParams(**off.as_request()) == off  # what a remote client sends, the server reads back
    with pytest.raises(TypeError, match="close_on_length must be true or false"):
        StructuredOutputsParams(regex="a+", close_on_length="no")


def test_sampling_params_refuse_ignore_eos_and_wrong_types():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a+"})


# ---- masks ------------------------------------------------------------------------------------------------------
class _Allow:
    """A matcher stand-in allowing a fixed set of tokens."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.consumed = tokens, []
        self.error = None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.tokens:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def consume(self, tok: int) -> bool:
        self.consumed.append(tok)
        return tok in self.tokens


def test_bitmask_round_trip_and_apply():
    vocab = 70  # not a multiple of 32: the last word's high bits are padding
    mask = allocate_bitmask(2, vocab)
    assert mask.shape == (2, 3) and bool(allowed_tokens(mask, vocab).all())
    _Allow([0, 31, 32, 69]).fill(mask, 0)
    allowed = allowed_tokens(mask, vocab)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert bool(allowed[1].all())
    logits = torch.randn(2, vocab)
    before = logits.clone()
    apply_bitmask(logits, mask)
    assert torch.isinf(logits[0, ~allowed[0]]).all() and torch.equal(logits[0, allowed[0]], before[0, allowed[0]])
    assert torch.equal(logits[1], before[1])


def test_constrain_touches_only_constrained_rows():
    logits = torch.randn(3, 64)
    raw = logits.clone()
    assert constrain(logits, [None, None, None], eos_token_id=2) is logits  # nothing constrained: no copy, no change
    kept = constrain(logits, [None, _Allow([5, 7]), None], eos_token_id=2, keep_raw=True)
    assert torch.equal(logits, raw)  # keep_raw: the raw logits survive for log-probabilities
    assert torch.equal(kept[0], raw[0]) and torch.equal(kept[2], raw[2])
    assert torch.isfinite(kept[1]).nonzero().flatten().tolist() == [5, 7]
    assert int(kept[1].argmax()) in (5, 7)
    # a grammar that allows nothing leaves the row EOS alone, so its request ends instead of sampling NaN
    ended = constrain(logits.clone(), [_Allow([]), None, None], eos_token_id=2)
    assert torch.isfinite(ended[0]).nonzero().flatten().tolist() == [2]


# ---- the compiler (the real tokenizer) ---------------------------------------------------------------------------
def test_compiler_names_invalid_constraints_and_caches(engine):
    compiler = engine.grammars
    with pytest.raises(ValueError, match="invalid JSON schema: .*frobnicate"):
        compiler.prepare(StructuredOutputsParams(json={"type": "frobnicate"}))
    with pytest.raises(ValueError, match="invalid regex"):
        compiler.prepare(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="invalid grammar"):
        compiler.prepare(StructuredOutputsParams(grammar="start: undefined_rule"))
    spec = StructuredOutputsParams(json=Finding.model_json_schema())
    compiler.prepare(spec)
    cached = compiler._cache[spec.key]
    compiler.prepare(StructuredOutputsParams(json=Finding.model_json_schema()))  # an equal spec: a cache hit
    assert compiler._cache[spec.key] is cached
    # the invalid one is cached as its error, and raised again without recompiling
    with pytest.raises(ValueError, match="frobnicate"):
        compiler.matcher(StructuredOutputsParams(json={"type": "frobnicate"}))


def test_invalid_constraint_adds_nothing(engine):
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json={"type": "frobnicate"}))
    with pytest.raises(ValueError, match="invalid JSON schema"):
        engine.generate(["hello", "there"], [SamplingParams(max_tokens=4), bad])
    assert not engine.has_unfinished()


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def test_choice_regex_and_json_object(engine):
    tok = engine.tokenizer
    prompts = [_chat(tok, "Is the sky green?"), _chat(tok, "Name a famous scientist."),
               _chat(tok, "Describe a cat as JSON."), _chat(tok, "Pick a colour.")]
    params = [SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(
                  choice=["yes", "no", "maybe not"])),
              SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputsParams(
                  regex=r"So the answer is [A-Z][a-z]+( [A-Z][a-z]+)?\.")),
              SamplingParams(max_tokens=48, temperature=0, structured_outputs=StructuredOutputsParams(
                  json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                        "required": ["name"], "additionalProperties": False})),
              SamplingParams(max_tokens=6, temperature=0.9, seed=3, structured_outputs=StructuredOutputsParams(
                  choice=["red", "green", "blue"]))]
    outs = engine.generate(prompts, params)
    assert outs[0].text in ("yes", "no", "maybe not") and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"So the answer is [A-Z][a-z]+( [A-Z][a-z]+)?\.", outs[1].text), outs[1].text
    assert set(json.loads(outs[2].text)) == {"name"}
    assert outs[3].text in ("red", "green", "blue")


def test_a_grammar_that_ends_stops_the_request(engine):
    """When the grammar's language ends, the request finishes there ("stop", no EOS sampled, no step spent on one),
    even when that is the last token of its budget."""
    prompt = _chat(engine.tokenizer, "Is the sky blue?")
    spec = StructuredOutputsParams(grammar=VERDICT)
    out = engine.generate(prompt, SamplingParams(max_tokens=32, temperature=0, structured_outputs=spec))[0]
    assert out.text in ("The answer is yes.", "The answer is no.") and out.finish_reason == "stop"
    assert not set(out.token_ids) & engine.eos_token_ids
    assert engine.tokenizer.decode(out.token_ids) == out.text
    exact = engine.generate(prompt, SamplingParams(max_tokens=len(out.token_ids), temperature=0,
                                                   structured_outputs=spec))[0]
    assert exact.token_ids == out.token_ids and exact.finish_reason == "stop"  # ended by the grammar, not the budget


def test_a_recursive_lark_grammar_holds_the_output(engine):
    prompt = _chat(engine.tokenizer, "What is 7 times 6 plus 3?")
    free = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0]
    spec = StructuredOutputsParams(grammar=ARITHMETIC)
    out = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0, structured_outputs=spec))[0]
    assert out.finish_reason == "stop", out.text  # ended by EOS, which the grammar allows after a whole expression
    tree = ast.parse(out.text, mode="eval")  # an independent parser of the same language
    assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult))
               for n in ast.walk(tree)), out.text
    assert any(isinstance(n, ast.BinOp) for n in ast.walk(tree)), out.text
    with pytest.raises(SyntaxError):  # the model alone answers in prose
        ast.parse(free.text, mode="eval")


def test_a_json_schema_cut_inside_a_string_is_closed(engine):
    """At max_tokens inside a string, the output is closed (string, object) in the budget's last tokens: it parses
    and validates, finish_reason stays "length", and the model's own tokens are kept up to the closing. Switched off,
    the same request is cut mid-string."""
    prompt = _chat(engine.tokenizer, "Describe Paris as JSON with a long summary.")
    schema = Portrait.model_json_schema()
    outs = {}
    for close in (True, False):
        params = SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputsParams(
            json=schema, close_on_length=close))
        outs[close] = engine.generate(prompt, params)[0]
    on, off = outs[True], outs[False]
    assert on.finish_reason == off.finish_reason == "length"
    assert len(on.token_ids) == len(off.token_ids) == 24
    with pytest.raises(json.JSONDecodeError):
        json.loads(off.text)
    assert re.search(r'"summary": "[^"]+$', off.text), off.text  # the cut is inside the summary string
    portrait = Portrait.model_validate_json(on.text)
    assert portrait.summary and off.text.split('"summary": "')[1].startswith(portrait.summary)
    kept = next(i for i, (a, b) in enumerate(zip(on.token_ids + [-1], off.token_ids)) if a != b)
    assert kept >= 24 - 3, (on.text, off.text)  # only the closing's tokens differ


def test_a_budget_that_suffices_is_left_alone(engine):
    prompt = _chat(engine.tokenizer, "Tell me about Rome as JSON.")
    spec = StructuredOutputsParams(json=City.model_json_schema())
    free = engine.generate(prompt, SamplingParams(max_tokens=200, temperature=0, structured_outputs=spec))[0]
    assert free.finish_reason == "stop"
    City.model_validate_json(free.text)
    # a few tokens to spare: the guard plans at every step (the budget is inside its horizon) and forces nothing
    tight = SamplingParams(max_tokens=len(free.token_ids) + 3, temperature=0, structured_outputs=spec)
    assert len(free.token_ids) + 3 <= 32
    out = engine.generate(prompt, tight)[0]
    assert out.token_ids == free.token_ids and out.finish_reason == "stop"


def test_logprobs_of_constrained_rows_are_of_the_raw_distribution(engine):
    tok = engine.tokenizer
    prompt = _chat(tok, "Is water wet?")
    free = engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0]
    forced = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                    structured_outputs=StructuredOutputsParams(choice=["zebra"])))[0]
    assert forced.text == "zebra"
    first = forced.logprobs[0]
    # the same position, the same raw distribution: the unconstrained top tokens are reported unchanged
    assert [t for t, _ in first.top] == [t for t, _ in free.logprobs[0].top]
    assert first.logprob < first.top[0][1]  # the forced token is not the model's first choice


def test_handed_off_request_keeps_its_constraint(engine):
    spec = StructuredOutputsParams(json=Finding.model_json_schema())
    params = SamplingParams(max_tokens=200, temperature=0, structured_outputs=spec)
    prompt = _chat(engine.tokenizer, "Report a finding about the Eiffel Tower as JSON.")
    want = engine.generate(prompt, params)[0]
    engine.add_generate(prompt, params, request_id="h1", handoff=True)
    handoff = None
    while handoff is None:
        handoff = next((o for o in engine.step() if o.request_id == "h1"), None)
    engine.add_prefilled(handoff)  # the matcher is rebuilt and replays the output so far
    got = engine.run_until_done()["h1"]
    assert got.token_ids == want.token_ids
    Finding.model_validate_json(got.text)
    wrong = type(handoff)(**{**handoff.__dict__, "request_id": "h2",
                             "output_token_ids": engine.tokenizer.encode("nope", add_special_tokens=False)})
    with pytest.raises(ValueError, match="does not follow its constraint"):
        engine.add_prefilled(wrong)


# more constrained requests than the engine's max_num_seqs (32): full batches of constrained rows, and more waiting
NUM_CONSTRAINED, NUM_FREE, NUM_TEXTS = 48, 12, 16


def test_many_nested_schema_requests_in_mixed_steps(engine):
    """48 constrained requests (half streamed), 12 unconstrained ones and 16 embeddings share steps: every
    constrained output validates against the schema, and the unconstrained ones equal their tokens in a run with no
    constrained request at all."""
    assert NUM_CONSTRAINED > engine.config.scheduler.max_num_seqs
    tok = engine.tokenizer
    topics = ["the Eiffel Tower", "the Moon landing", "penicillin", "the printing press", "Mount Everest",
              "the telephone", "the Great Wall", "DNA", "the steam engine", "the Internet"]
    constrained = [_chat(tok, f"As JSON, report a finding about {topics[i % 10]} (note {i}).")
                   for i in range(NUM_CONSTRAINED)]
    free = [_chat(tok, f"Say something short about {topics[i % 10]} ({i}).") for i in range(NUM_FREE)]
    texts = [f"passage {i} about {topics[i % 10]}" for i in range(NUM_TEXTS)]
    greedy = SamplingParams(max_tokens=192, temperature=0, structured_outputs=FINDING)
    c_params = [greedy if i % 4 else SamplingParams(max_tokens=192, temperature=0.7, seed=i,
                                                    structured_outputs=FINDING) for i in range(NUM_CONSTRAINED)]
    f_params = SamplingParams(max_tokens=12, temperature=0)
    want, _ = engine.run(free, f_params, texts)  # the reference: no constrained request in any step

    async def main():
        async with AsyncEngine(engine) as aeng:
            first = engine.num_steps

            async def streamed(prompt, params):
                last = None
                async for snap in aeng.generate_stream(prompt, params):
                    assert last is None or snap.text.startswith(last.text)
                    last = snap
                return last

            jobs = [aeng.generate(p, f_params) for p in free]
            jobs += [streamed(p, c) if i % 2 else aeng.generate(p, c)
                     for i, (p, c) in enumerate(zip(constrained, c_params))]
            results = await asyncio.gather(asyncio.gather(*jobs), aeng.embed_many(texts))
            return results[0], list(engine.step_stats)[-(engine.num_steps - first):]

    outs, steps = asyncio.run(main())
    assert len(outs) == NUM_FREE + NUM_CONSTRAINED
    for out in outs[NUM_FREE:]:
        assert out.finish_reason == "stop", out.text
        Finding.model_validate_json(out.text)
    assert [o.token_ids for o in outs[:NUM_FREE]] == [o.token_ids for o in want[:NUM_FREE]]
    # the forward carried all three: constrained rows, free generation rows and embedding rows
    assert any(s.num_constrained_rows and s.num_sampled_rows > s.num_constrained_rows and s.num_forward_embed_rows
               for s in steps)


def test_async_engine_compiles_off_the_engine_thread(engine, monkeypatch):
    compiler = engine.grammars
    threads: list[str] = []
    real = compiler._compile

    def spy(spec):
        threads.append(threading.current_thread().name)
        return real(spec)

    monkeypatch.setattr(compiler, "_compile", spy)
    spec = StructuredOutputsParams(regex=r"(yes|no), (really|truly)\.")
    bad = StructuredOutputsParams(regex="(unclosed")

    async def main():
        async with AsyncEngine(engine) as aeng:
            out = await aeng.generate("Is it true?", SamplingParams(max_tokens=8, temperature=0,
                                                                    structured_outputs=spec))
            with pytest.raises(ValueError, match="invalid regex"):
                await aeng.generate("Is it true?", SamplingParams(max_tokens=8, structured_outputs=bad))
            return out

    out = asyncio.run(main())
    assert re.fullmatch(r"(yes|no), (really|truly)\.", out.text)
    assert threads and "orthrus-async-engine" not in threads
