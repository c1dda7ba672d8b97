"""Grammars from constraints, compiled once per model and constraint, and a fresh matcher per request.

llguidance is the library (scripts/bench_grammar_backends.py measured it against xgrammar on this project's CPUs:
no ahead-of-time compile, so a new schema costs about a millisecond instead of 4-400 ms, and no GPU-oriented
dependencies). This module is the only one that imports it: the seam is `GrammarCompiler.matcher(spec)`, the
`Matcher` it returns (consume a token, is it done) and `fill_masks` (a step's rows of masks at once).

Compiling happens off the step loop: front ends call `prepare` in a worker thread before they submit (the
`AsyncEngine` and the server do), so the engine's own call is a cache hit.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from orthrus_rag.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled constraints kept per model (a server sees a few schemas many times)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, inner: Any) -> None:
        self._m = inner

    def consume(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar refused it (the mask should have prevented it)."""
        return bool(self._m.consume_token(token_id))

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (its EOS was consumed)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


_executor: Any = None
_executor_lock = threading.Lock()


def fill_masks(matchers: list[Matcher], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` := the tokens `matchers[i]` allows next, computed on llguidance's own threads (the
    Python caller holds no lock meanwhile: the runner calls it from a worker thread while the forward runs)."""
    global _executor
    import llguidance
    import llguidance.torch

    with _executor_lock:
        if _executor is None:
            # NOTE: half the cores: the forward runs on the others at the same time
            _executor = llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
    llguidance.torch.fill_next_token_bitmask_par(_executor, [(m._m, i) for i, m in enumerate(matchers)], bitmask)


class GrammarCompiler:
    """Constraints -> grammars for one tokenizer and vocabulary width (the logits' width, which may exceed the
    tokenizer's: padded embedding rows are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int] | list[int] | None = None) -> None:
        import llguidance.hf

        eos = sorted(eos_token_ids or []) or None
        # NOTE: the engine's EOS set, not only the tokenizer's: the grammar ends an output by allowing exactly
        # the tokens the engine stops on
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> pristine matcher, or the ValueError it raised

    def grammar_text(self, spec: StructuredOutputsParams) -> str:
        """llguidance's grammar for a constraint."""
        from llguidance import LLMatcher

        kind = spec.kind
        options = {"whitespace_flexible": spec.whitespace_flexible, "item_separator": ", ", "key_separator": ": "}
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(json.dumps(spec.json), defaults=options)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return LLMatcher.grammar_from_lark(spec.grammar)

    def prepare(self, spec: StructuredOutputsParams) -> None:
        """Compile `spec` into the cache (call it from a worker thread); ValueError naming what is wrong."""
        self._pristine(spec)

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        """A new request's matcher (a copy of the cached, compiled one); ValueError for an invalid constraint."""
        return Matcher(self._pristine(spec).deep_copy())

    def _pristine(self, spec: StructuredOutputsParams) -> Any:
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(spec)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(hit, ValueError):
            raise ValueError(str(hit))
        return hit

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        from llguidance import LLMatcher

        try:
            text = self.grammar_text(spec)
        except (ValueError, RuntimeError, TypeError) as exc:  # the converters raise on what they cannot read
            return ValueError(f"invalid {_what(spec)}: {exc}")
        matcher = LLMatcher(self._tokenizer, text)
        if matcher.is_error():
            return ValueError(f"invalid {_what(spec)}: {matcher.get_error()}")
        return matcher


def _what(spec: StructuredOutputsParams) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[spec.kind]


# one compiler per (tokenizer, vocabulary width): the server's checks and the engine's requests share its cache
_compilers: weakref.WeakKeyDictionary[Any, dict[tuple, GrammarCompiler]] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int, eos_token_ids: set[int] | list[int] | None = None,
                 ) -> GrammarCompiler:
    """The shared compiler of a tokenizer (its vocabulary is read once per model: ~0.2 s for 49k tokens)."""
    key = (vocab_size, tuple(sorted(eos_token_ids or ())))
    with _compilers_lock:
        per_model = _compilers.setdefault(tokenizer, {})
        if key not in per_model:
            per_model[key] = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        return per_model[key]
