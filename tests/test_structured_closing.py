"""Closing a structured output within its token budget (orthrus_rag/structured/closing.py, budget.py), on SmolLM2's
tokenizer and a random "model": closings found from any state parse under their grammar, and outputs sampled through
the runner's own mask and advance steps parse at every budget that can hold the schema's skeleton, where the same
outputs without the switch do not."""

from __future__ import annotations

import functools
import json
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from orthrus_rag.params import StructuredOutputsParams
from orthrus_rag.structured.bitmask import advance, constrain
from orthrus_rag.structured.closing import ByteTokens, closing_tokens
from orthrus_rag.structured.compiler import GrammarCompiler


class Place(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str
    year: int = Field(ge=1000, le=2100)


class Report(BaseModel):
    """A nested object, a free string, an array of strings and an enum: what a closing has to finish."""

    model_config = ConfigDict(extra="forbid")
    name: str
    place: Place
    tags: list[str]
    level: Literal["low", "medium", "high"]


class Node(BaseModel):
    """A tree: a model that keeps opening children never finishes on its own."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=3)
    children: list[Node]


REPORT = StructuredOutputsParams(json=Report.model_json_schema())
TREE = StructuredOutputsParams(json=Node.model_json_schema())
COLOURS = StructuredOutputsParams(grammar='start: "Colours: " colour (", " colour)* "."\n'
                                          'colour: "red" | "green" | "blue" | "yellow" | "black" | "white"')


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One row of logits per step here: torch's thread pool only adds waits (seconds, on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compiler(smol_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smol_tokenizer, len(smol_tokenizer), {smol_tokenizer.eos_token_id})


@pytest.fixture(scope="module")
def byte_tokens(compiler) -> ByteTokens:
    return ByteTokens(compiler._tokenizer)


def _at(compiler: GrammarCompiler, spec: StructuredOutputsParams, prefix: str):
    """A matcher of `spec` (no budget) advanced past `prefix`."""
    matcher = compiler.matcher(spec)
    ids = compiler._tokenizer.tokenize_str(prefix)
    assert all(matcher.consume(t) for t in ids), prefix
    return matcher


@pytest.mark.parametrize("prefix", [
    "", '{"name": "Par', '{"name": "a}]', '{"name": "Paris", "place": {"city": "x',
    '{"name": "Paris", "place": {"city": "x", "year": 19',
    '{"name": "a", "place": {"city": "b", "year": 2000}, "tags": [',
    '{"name": "a", "place": {"city": "b", "year": 2000}, "tags": ["ab',
    '{"name": "a", "place": {"city": "b", "year": 2000}, "tags": ["ab"], "level": "me'])
def test_a_closing_from_any_json_state_validates(compiler, byte_tokens, prefix):
    matcher = _at(compiler, REPORT, prefix)
    plan = closing_tokens(matcher._m, byte_tokens)
    assert plan, "an unfinished object needs a closing"
    Report.model_validate_json(prefix + compiler._tokenizer.decode_str(plan))
    # the matcher is left where it was: the plan is still its way to the end
    assert all(matcher.consume(t) for t in plan) and matcher._m.is_accepting()


def test_closings_are_short_and_empty_when_complete(compiler, byte_tokens):
    decode = compiler._tokenizer.decode_str
    inside = _at(compiler, REPORT, '{"name": "a", "place": {"city": "b", "year": 2000}, "tags": ["ab')
    assert decode(closing_tokens(inside._m, byte_tokens)) == '"], "level": "high"}'  # `[]` closes, no new item
    done = _at(compiler, REPORT, '{"name": "a", "place": {"city": "b", "year": 2000}, "tags": [], "level": "low"}')
    assert closing_tokens(done._m, byte_tokens) == []


def test_a_lark_list_is_closed_by_its_end_not_by_more_items(compiler, byte_tokens):
    # greedy would take "," (below ".") for ever; the breadth-first fallback finds the end
    matcher = _at(compiler, COLOURS, "Colours: red, blue")
    assert compiler._tokenizer.decode_str(closing_tokens(matcher._m, byte_tokens)) == "."


def _random_model(compiler: GrammarCompiler, spec: StructuredOutputsParams, budget: int, seed: int,
                  favour: str = "", avoid: str = "") -> tuple[str, bool]:
    """`budget` tokens (or up to EOS) drawn among those the grammar allows, through the runner's own `constrain`
    and `advance`: uniformly, but among tokens with a character of `favour` in them when the grammar allows one, and
    tokens with one of `avoid` only when it allows nothing else. The text, and whether the matcher says it closed the
    output for the budget."""
    matcher = compiler.matcher(spec, budget)
    gen = torch.Generator().manual_seed(seed)
    eos = compiler._eos
    bias = _bias(compiler, favour, avoid)
    kept: list[int] = []
    while len(kept) < budget:
        logits = torch.randn(1, compiler.vocab_size, generator=gen) + bias
        tok = int(constrain(logits, [matcher], eos).argmax())
        got = advance([matcher], [tok])[0]
        if got == eos:
            break
        kept.append(got)
    return compiler._tokenizer.decode_str(kept), matcher.closed_on_length


@functools.cache
def _bias(compiler: GrammarCompiler, favour: str, avoid: str) -> torch.Tensor:
    bias = torch.zeros(compiler.vocab_size)
    if favour or avoid:
        texts = [compiler._tokenizer.decode_str([t]) for t in range(compiler.vocab_size)]
        bias[[t for t, text in enumerate(texts) if set(text) & set(favour)]] = 100.0
        bias[[t for t, text in enumerate(texts) if set(text) & set(avoid)]] = -100.0
    return bias


def test_random_outputs_close_at_every_budget_that_holds_the_skeleton(compiler, byte_tokens):
    """Random tokens open strings, arrays and objects at any point; at every budget from the skeleton's length up,
    the output parses and validates, and the budget ended it. Without the switch the same draws are cut."""
    skeleton = len(closing_tokens(compiler.matcher(REPORT)._m, byte_tokens))
    cut = 0
    for budget in range(skeleton, skeleton + 40, 3):
        text, closed = _random_model(compiler, REPORT, budget, seed=budget)
        Report.model_validate_json(text)
        assert closed
        off, _ = _random_model(compiler, StructuredOutputsParams(json=REPORT.json, close_on_length=False), budget,
                               seed=budget)
        try:
            json.loads(off)
        except json.JSONDecodeError:
            cut += 1
    assert cut >= 10, "without the switch, random outputs should mostly be cut"


def test_a_model_that_keeps_opening_structure_is_closed_in_time(compiler, byte_tokens):
    """Favouring `{` and never closing anything itself, the model nests children as deep as the budget lets it: the
    guard must refuse (replace) the token that opens one level too many, not only force the closing at the end."""
    skeleton = len(closing_tokens(compiler.matcher(TREE)._m, byte_tokens))
    depths = []
    for budget in range(skeleton, skeleton + 30, 2):
        text, closed = _random_model(compiler, TREE, budget, seed=budget, favour="{", avoid="]}")
        tree, depth = Node.model_validate_json(text), 0
        while tree.children:
            tree, depth = tree.children[0], depth + 1
        depths.append(depth)
        assert closed, text
        off, _ = _random_model(compiler, StructuredOutputsParams(json=TREE.json, close_on_length=False), budget,
                               seed=budget, favour="{", avoid="]}")
        with pytest.raises(json.JSONDecodeError):
            json.loads(off)
    assert depths == sorted(depths) and depths[-1] >= 2, depths  # a larger budget, deeper nesting


def test_only_a_token_that_cannot_close_in_time_is_replaced(compiler, byte_tokens):
    nested = StructuredOutputsParams(json={"type": "object", "properties": {"a": {
        "type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False})
    tokenize, decode = compiler._tokenizer.tokenize_str, compiler._tokenizer.decode_str
    prefix = tokenize('{"a": {"b": "xy')
    plan = closing_tokens(_at(compiler, nested, '{"a": {"b": "xy')._m, byte_tokens)
    assert decode(plan) == '"}}' and len(plan) == 2

    def at_prefix(spare: int):
        matcher = compiler.matcher(nested, budget=len(prefix) + len(plan) + spare)
        assert all(matcher.consume(t) for t in prefix)
        return matcher

    [z], [quote_brace] = tokenize("z"), tokenize('"}')
    tight = at_prefix(0)
    assert tight.take(z) == plan[0] and tight.closed_on_length  # a letter more would leave no room to close
    own = at_prefix(0)
    assert own.take(quote_brace) == quote_brace and not own.closed_on_length  # the model's own closing fits
    assert own.take(tokenize("}")[0]) == tokenize("}")[0] and own._m.is_accepting()
    roomy = at_prefix(1)
    assert roomy.take(z) == z and not roomy.closed_on_length


def test_a_budget_below_the_skeleton_changes_nothing(compiler, byte_tokens):
    skeleton = len(closing_tokens(compiler.matcher(REPORT)._m, byte_tokens))
    for seed in range(3):
        on, closed = _random_model(compiler, REPORT, skeleton - 1, seed)
        off, _ = _random_model(compiler, StructuredOutputsParams(json=REPORT.json, close_on_length=False),
                               skeleton - 1, seed)
        assert on == off and not closed


def test_a_lark_grammar_closes_within_its_budget(compiler):
    """A model favouring "," lists colours for ever: the budget ends the list with its "."."""
    for budget in (6, 9, 14):
        text, closed = _random_model(compiler, COLOURS, budget, seed=budget, favour=",")
        assert closed and text.startswith("Colours: ") and text.endswith("."), text
        items = text.removeprefix("Colours: ").removesuffix(".").split(", ")
        assert set(items) <= {"red", "green", "blue", "yellow", "black", "white"}, text
        off, _ = _random_model(compiler, StructuredOutputsParams(grammar=COLOURS.grammar, close_on_length=False),
                               budget, seed=budget, favour=",")
        assert not off.endswith("."), off


def test_a_grammar_with_no_closing_found_is_searched_a_few_times(compiler, monkeypatch):
    """The pipelines' `constrained` answer: free text, then a fixed sentence. No closer leads to that sentence, so
    no plan is found; the output is left as it is, and the search backs off instead of running at every token."""
    from orthrus_rag.structured import budget

    searches = []
    real = budget.closing_tokens
    monkeypatch.setattr(budget, "closing_tokens", lambda *a: searches.append(1) or real(*a))
    answer = StructuredOutputsParams(regex=r"(?:[^\n]{0,300}[.!?] )?So the answer is [^\n]{1,100}\.")
    on, closed = _random_model(compiler, answer, 32, seed=1)
    off, _ = _random_model(compiler, StructuredOutputsParams(regex=answer.regex, close_on_length=False), 32, seed=1)
    assert on == off and not closed
    assert 1 <= len(searches) <= 7, len(searches)  # 32 tokens: after 1, 2, 4, 8, 16 tokens (+ the skeleton's)
