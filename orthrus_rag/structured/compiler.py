"""Grammars from constraints, compiled once per model and constraint, and a fresh matcher per request.

llguidance is the library (measured against xgrammar on this project's CPUs, docs/benchmarks/features.md:
no ahead-of-time compile, so a new schema costs about a millisecond instead of 4-400 ms, and no GPU-oriented
dependencies). This module is the only one that imports it: the seam is `GrammarCompiler.matcher(spec)`, the
`Matcher` it returns (consume a token, is it done) and `fill_masks` (a step's rows of masks at once). (budget.py and
closing.py call methods of the llguidance matchers they are handed, and import nothing of it.)

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
from orthrus_rag.structured.budget import HORIZON, LengthGuard
from orthrus_rag.structured.closing import ByteTokens, closing_tokens

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled constraints kept per model (a server sees a few schemas many times)


class Matcher:
    """One request's position in its grammar, and, with a token budget, its `LengthGuard` (budget.py)."""

    def __init__(self, inner: Any, guard: LengthGuard | None = None) -> None:
        self._m = inner
        self._guard = guard

    def consume(self, token_id: int) -> bool:
        """Advance past a token as it is (a handed-off request's output replayed); False if the grammar refused
        it."""
        ok = bool(self._m.consume_token(token_id))
        if ok and self._guard is not None:
            self._guard.consumed(token_id)
        return ok

    def take(self, token_id: int) -> int | None:
        """Advance past a sampled token, or past the token that replaces it to close the output within its budget
        (`LengthGuard.take`); the token consumed, None if the grammar refused it (the mask should have prevented
        it)."""
        if self._guard is None:
            return token_id if self._m.consume_token(token_id) else None
        kept = self._guard.take(self._m, token_id)
        return None if self._m.is_error() else kept

    def prepare_closing(self) -> None:
        """Compute the closing plan the next `take` may need, if it is due (from the mask worker: off the step's
        critical path)."""
        if self._guard is not None:
            self._guard.prepare(self._m)

    @property
    def closed_on_length(self) -> bool:
        """Sampled tokens were replaced to close the output within its budget: it ended for lack of tokens."""
        return self._guard is not None and self._guard.closed

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
        self._eos = eos[0] if eos else None
        self._byte_tokens: ByteTokens | None = None  # for closing plans (budget.py), read on first use
        self._skeletons: dict[str, int] = {}  # constraint key -> tokens closing its empty output
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
        pristine = self._pristine(spec)
        if spec.close_on_length:
            self._skeleton(spec, pristine)

    def matcher(self, spec: StructuredOutputsParams, budget: int | None = None) -> Matcher:
        """A new request's matcher (a copy of the cached, compiled one); ValueError for an invalid constraint.
        `budget`: the most tokens the output may have; with `spec.close_on_length` the matcher then closes the
        structure before they run out."""
        pristine = self._pristine(spec)
        if budget is None or not spec.close_on_length:
            return Matcher(pristine.deep_copy())
        skeleton = self._skeleton(spec, pristine)
        assert self._byte_tokens is not None
        return Matcher(pristine.deep_copy(), LengthGuard(budget, self._byte_tokens, self._eos,
                                                         horizon=max(HORIZON, 2 * skeleton)))

    def _skeleton(self, spec: StructuredOutputsParams, pristine: Any) -> int:
        """Tokens closing the constraint's empty output (what its plans start from), found once per constraint
        (`prepare` does it off the engine thread)."""
        with self._lock:
            if self._byte_tokens is None:
                self._byte_tokens = ByteTokens(self._tokenizer)
            skeleton = self._skeletons.get(spec.key)
        if skeleton is None:
            skeleton = len(closing_tokens(pristine, self._byte_tokens) or ())
            with self._lock:
                self._skeletons[spec.key] = skeleton
                while len(self._skeletons) > CACHE_SIZE:
                    del self._skeletons[next(iter(self._skeletons))]
        return skeleton

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
