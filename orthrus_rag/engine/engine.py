"""The synchronous engine: add requests of both kinds, step, collect outputs.

`step()` is the whole step: the scheduler decides, the runner runs one flat batch (plus the encoder), the scheduler
applies the outcome (`update_from_output`: tokens, stops, freed blocks) and the engine turns it into outputs. Every
front end drives it through the one `EngineLoop` (engine/loop.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from orthrus_rag.config import EngineConfig
from orthrus_rag.engine.batch_calls import BatchCalls
from orthrus_rag.engine.core.block_manager import BlockManager, PrefixCachingBlockManager
from orthrus_rag.engine.core.request import Request, RequestKind, RequestStatus
from orthrus_rag.engine.core.scheduler import Scheduler
from orthrus_rag.engine.core.step_output import StepResult
from orthrus_rag.engine.continuation import Continuations
from orthrus_rag.engine.core.step_cost import StepCostModel
from orthrus_rag.engine.executor.calibration import calibrate
from orthrus_rag.engine.executor.plan import describe
from orthrus_rag.engine.executor.runner import ModelRunner
from orthrus_rag.engine.handoff import Handoffs
from orthrus_rag.engine.rerankers import Reranker, build_rerankers
from orthrus_rag.engine.stats import planned_stats
from orthrus_rag.engine.text_io import InputProcessor, stream_text, update_output
from orthrus_rag.layers.sampler import make_generator
from orthrus_rag.outputs import (
    EmbeddingOutput,
    EngineOutput,
    GenerationOutput,
    RequestMetrics,
    StepStats,
)
from orthrus_rag.params import EmbeddingRoute, EmbeddingSpace, PoolingParams, RerankParams, SamplingParams
from orthrus_rag.structured.compiler import GrammarCompiler, compiler_for

logger = logging.getLogger(__name__)


class Engine(BatchCalls, Handoffs):
    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer: Any,
                 adapter_slots: dict[str, int] | None = None, encoder: torch.nn.Module | None = None,
                 encoder_tokenizer: Any = None, encoder_pooling: dict | None = None,
                 adapter_kinds: dict[str, str] | None = None,
                 adapter_prefixes: dict[str, dict[str, str]] | None = None,
                 cross_encoders: dict[str, tuple[torch.nn.Module, Any]] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.adapter_slots = dict(adapter_slots or {})
        # name -> "generate" | "embed" | "both"; an adapter without one embeds (the embedding_adapters' kind)
        self.adapter_kinds = dict(adapter_kinds or {})
        self.adapter_prefixes = dict(adapter_prefixes or {})  # name -> input type -> prefix (the adapters' cards)
        self._space: EmbeddingSpace | None = None  # what `embedding_space` reports, made on first use
        self.encoder_pooling = encoder_pooling or {}
        hf = model.config
        max_len = config.model.max_model_len or hf.max_position_embeddings
        cache = config.cache
        # NOTE: the model's own dtype (what `from_config` loaded it in, or what a caller built): the KV cache and
        # the kernels follow the weights
        dtype = next(model.parameters()).dtype
        num_blocks = cache.resolve_num_blocks(kv_bytes_per_token(model, dtype))
        manager = PrefixCachingBlockManager if cache.enable_prefix_caching else BlockManager
        self.block_manager = manager(num_blocks, cache.block_size)
        # a generation stops ("length") before it outgrows the model's positions or the whole KV cache
        self.max_seq_len = min(max_len, num_blocks * cache.block_size)
        eos = hf.eos_token_id if hf.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.scheduler = Scheduler(config.scheduler, self.block_manager, partial(
            update_output, tokenizer=tokenizer, eos_token_ids=self.eos_token_ids, max_seq_len=self.max_seq_len),
            StepCostModel() if _sizes_steps_by_cost(config) or config.scheduler.slo.bounds_step_time else None,
            decode_margin=_sizes_steps_by_cost(config))
        cross_encoders = cross_encoders or {}
        self.runner = ModelRunner(model, config, num_blocks, dtype, encoder, self.max_seq_len, self.eos_token_ids,
                                  {name: m for name, (m, _) in cross_encoders.items()})
        # what each part of a step runs here, read from the loaded model and runner (engine/executor/plan.py)
        self.plan = describe(self.runner)
        logger.info("plan: %s", self.plan.summary())
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request
        if self.scheduler.cost_model is not None:
            calibrate(self.runner, self.scheduler.cost_model, config.scheduler.max_num_batched_tokens)
        self.inputs = InputProcessor(
            tokenizer, hf.vocab_size, max_len, num_blocks * cache.block_size, encoder_tokenizer,
            encoder.config.vocab_size if encoder is not None else 0,
            getattr(encoder, "max_seq_length", encoder.max_position_embeddings) if encoder is not None else 0)
        # (query, document) scorers by name, the first the default (engine/rerankers.py)
        self.rerankers = build_rerankers(config.model.rerankers, cross_encoders, encoder, tokenizer,
                                         model.compute_logits, dtype, min(max_len, num_blocks * cache.block_size),
                                         self._adapter_slot)
        self._ids = itertools.count()
        self.continuations = Continuations()  # finished generations `continue_` may extend (engine/continuation.py)
        self.num_steps = 0
        self.step_stats: deque[StepStats] = deque(maxlen=100_000)  # bounded: long-lived servers
        # called with every step's statistics (metrics, run summaries, steps.jsonl); must not raise or block
        self.step_observers: list[Callable[[StepStats], None]] = []

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m-instruct", embedding_adapters: str | list[str] | None = None,
                        embedding_model: str | None = None, **overrides: Any) -> "Engine":
        """Load a decoder (built-in name, folder, .gguf or hub id), optional PEFT embedding adapters and an
        optional separate encoder. `overrides` set EngineConfig fields or sub-config fields by name
        (e.g. `max_num_batched_tokens=128`, `num_blocks=512`, `dtype="bfloat16"`)."""
        from orthrus_rag.config.build import engine_config

        return cls.from_config(engine_config(model, embedding_adapters, embedding_model, **overrides))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        """Load the weights `config` names and build the engine (the one way every caller builds one)."""
        from orthrus_rag.engine.core.policies import check_policy
        from orthrus_rag.engine.executor.loading import load_models

        check_policy(config.scheduler.policy)  # NOTE: before any weights load
        loaded = load_models(config)
        return cls(config, loaded.model, loaded.tokenizer, loaded.adapter_slots, loaded.encoder,
                   loaded.encoder_tokenizer, loaded.encoder_pooling, loaded.adapter_kinds, loaded.adapter_prefixes,
                   loaded.cross_encoders)

    # ---- submission -------------------------------------------------------------------------------------
    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def add_generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, stream: bool = False, handoff: bool = False) -> str:
        """Queue a generation; with `stream`, every step that samples a token for it also returns an
        unfinished snapshot (`finished=False`). With `handoff`, the step that samples its first token returns a
        `HandoffOutput` (KV included, blocks freed) instead of continuing it, unless that token finished it."""
        params = params or SamplingParams()
        ids = self.inputs.prompt(prompt)
        slot = self.embedding_space.generation_slot(params.adapter)
        grammar = self._matcher(params, len(ids))
        req = Request(request_id or self._new_id("gen"), RequestKind.GENERATE, ids, sampling_params=params,
                      rng=make_generator(params.seed, self.config.model.device), stream=stream,
                      handoff=handoff, grammar=grammar, adapter_slot=slot)
        return self._add(req)

    def continue_(self, request_id: str, appended: str | Sequence[int] = (), params: SamplingParams | None = None,
                  stream: bool = False) -> str:
        """Continue the finished generation `request_id` (submitted with `SamplingParams.hold_kv_s`) after its last
        sampled token, with `appended` (text, tokenized without special tokens, or token ids; may be empty) and
        `params` (default: the generation's own). Queued under the same id; its output's tokens and text are the
        continuation's new ones. Its KV comes from the held blocks, or the prefix cache, or is recomputed."""
        record = self.continuations.get(request_id)  # NOTE: ValueError names what is missing
        if request_id in self.scheduler.requests:
            raise ValueError(f"request {request_id!r} is still running; continue it once it has finished")
        ids = list(record.token_ids) + self.inputs.appended(appended)
        return self.add_generate(ids, params or record.params, request_id, stream=stream)

    def release(self, request_id: str) -> bool:
        """Forget a finished generation nobody will continue: its record and its held KV go now, not at the
        deadline. Whether there was either."""
        had_hold = self.block_manager.release_hold(request_id)
        return self.continuations.forget(request_id) or had_hold

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of this model's constrained requests; `prepare(spec)` from a worker thread compiles a
        constraint before its request is submitted, so `add_generate` only copies a cached matcher."""
        if self._grammars is None:
            self._grammars = compiler_for(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        return self._grammars

    def _matcher(self, params: SamplingParams, num_prompt_tokens: int, tokens: Sequence[int] = ()) -> Any:
        """A constrained request's matcher, advanced past `tokens` (a handed-off request's output so far); its
        budget is where the request would stop for length (`max_tokens`, or the model's length)."""
        if params.structured_outputs is None:
            return None
        budget = min(params.max_tokens, self.max_seq_len - num_prompt_tokens)
        matcher = self.grammars.matcher(params.structured_outputs, budget)
        for tok in tokens:
            if not matcher.consume(tok):
                raise ValueError(f"the handed-off output does not follow its constraint at token {tok}")
        return matcher

    def add_embed(self, text: str | Sequence[int], params: PoolingParams | None = None,
                  request_id: str | None = None) -> str:
        route = self.embedding_route(params)
        params = self.embedding_space.formatted(params, route) if params is not None else \
            self.default_pooling_params()
        ids = self.inputs.embed_input(text, params, route.on_encoder)
        req = Request(request_id or self._new_id("emb"), RequestKind.EMBED, ids, pooling_params=params,
                      adapter_slot=route.slot, on_encoder=route.on_encoder)
        return self._add(req)

    def add_score(self, query: str, document: str, params: RerankParams | None = None,
                  request_id: str | None = None) -> str:
        """Queue one (query, document) pair for a reranker; its output is an `EmbeddingOutput` whose embedding is
        [relevance]. Pooled like an embedding, so it shares steps (and the embedding's priorities) with the rest."""
        params = params or RerankParams()
        pair = self.reranker(params.reranker).pair(query, document, params)
        req = Request(request_id or self._new_id("score"), RequestKind.SCORE, pair.token_ids,
                      pooling_params=pair.params, adapter_slot=pair.adapter_slot, on_encoder=pair.on_encoder,
                      encoder=pair.encoder, token_cost=pair.token_cost, token_type_ids=pair.token_type_ids,
                      keep_kv=not pair.on_encoder and self.config.cache.enable_prefix_caching)
        return self._add(req)

    def _adapter_slot(self, name: str) -> int:
        """A loaded adapter's slot, whatever its kind (a yes/no reading is a logits read)."""
        if name not in self.adapter_slots:
            raise ValueError(f"adapter {name!r} is not loaded; loaded: {', '.join(self.adapter_slots) or 'none'}")
        return self.adapter_slots[name]

    def reranker(self, name: str | None = None) -> Reranker:
        """A loaded reranker by name (None: the first); ValueError naming the loaded ones."""
        if not self.rerankers:
            raise ValueError("this engine loads no reranker; set model.rerankers (a cross-encoder, or backbone)")
        if name is None:
            return next(iter(self.rerankers.values()))
        if name not in self.rerankers:
            raise ValueError(f"unknown reranker {name!r}; loaded: {', '.join(self.rerankers)}")
        return self.rerankers[name]

    # ---- what an embedding runs on (public: embedders and servers ask, never the runner) -------------------
    @property
    def has_encoder(self) -> bool:
        return self.runner.encoder is not None

    @property
    def embedding_space(self) -> EmbeddingSpace:
        """What this engine's embeddings are (models, adapters, the encoder's pooling): the space its clients
        report and that owns the embedding route."""
        space = self._space
        if space is None or (space.adapter_slots, space.adapter_kinds, space.adapter_prefixes) != (
                self.adapter_slots, self.adapter_kinds, self.adapter_prefixes):
            # NOTE: built once; rebuilt if reassigned
            space = self._space = self._make_space()
        return space

    def _make_space(self) -> EmbeddingSpace:
        mc = self.config.model
        encoder = self.runner.encoder
        return EmbeddingSpace(mc.name, mc.embedding_model if encoder is not None else None,
                              tuple(mc.embedding_adapters), dict(self.adapter_slots), dict(self.encoder_pooling),
                              hidden_size=int(self.runner.model.config.hidden_size),
                              encoder_hidden_size=int(encoder.hidden_size) if encoder is not None else None,
                              adapter_kinds=dict(self.adapter_kinds), adapter_prefixes=dict(self.adapter_prefixes))

    def embedding_route(self, params: PoolingParams | None = None) -> EmbeddingRoute:
        """Where an embedding with `params` runs (ValueError for an unknown adapter)."""
        return self.embedding_space.route(params)

    def default_pooling_params(self) -> PoolingParams:
        return self.embedding_space.default_pooling()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of final backbone hidden states (e.g. rows of a pooling="all" embedding of a prompt
        and its output, to score tokens); call it on the engine's thread, such as inside a pooling head."""
        return self.runner.model.compute_logits(hidden)

    def embedding_dimension(self, route: EmbeddingRoute) -> int:
        """The width of the hidden states `route` pools (a pooling head may change it)."""
        return int(self.embedding_space.dimension(route))

    def _add(self, req: Request) -> str:
        self.scheduler.add(req)  # NOTE: refuses an id already in use
        return req.req_id

    def abort(self, request_id: str) -> EngineOutput | None:
        """Abort an unfinished request (its blocks freed at once); its final output, finish_reason "abort" (an
        embedding's is empty), or None if it is unknown or already finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort", time.monotonic(), RequestStatus.ABORTED)
        self.continuations.remember(req)  # NOTE: not continuable: an earlier round's record goes too
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time)
        if req.is_embed:
            return EmbeddingOutput(req.req_id, req.prompt_token_ids, torch.empty(0), "abort", metrics)
        return GenerationOutput(req.req_id, req.prompt_token_ids, list(req.output_token_ids), req.output_text, "abort",
                                metrics)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    # ---- the loop ---------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """Run one engine step; returns the outputs of requests that finished in it (and streaming snapshots)."""
        hits = self._prefix_hit_tokens()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        stats = planned_stats(self.num_steps, sched, len(self.scheduler.waiting), len(self.scheduler.running),
                               self.block_manager.num_used_blocks)
        stats.num_prefix_hit_tokens = self._prefix_hit_tokens() - hits
        for req in [s.req for s in sched.scheduled] + sched.encoder:
            req.first_scheduled_time = req.first_scheduled_time or now
        result = self.runner.execute(sched)
        stats.record_execution(result)
        # NOTE: the cost model learns the runner's device time (synchronised on CUDA), not the host's launch time
        done = self.scheduler.update_from_output(sched, result, time.monotonic(), result.seconds)
        stats.decode_gaps = done.decode_gaps
        outputs = [self._output(req, done) for req in done.finished]
        outputs += [self._hand_off(req) for req in done.handoffs]
        outputs += [GenerationOutput(req.req_id, req.prompt_token_ids, list(req.output_token_ids), stream_text(req),
                                     None, finished=False) for req in done.streamed]
        stats.step_time = time.monotonic() - now
        self.step_stats.append(stats)
        for observe in self.step_observers:
            observe(stats)
        self.num_steps += 1
        return outputs

    def _prefix_hit_tokens(self) -> int:
        """Prompt tokens served from cached blocks so far (0 without prefix caching)."""
        return getattr(self.block_manager, "num_hit_tokens", 0)

    def _output(self, req: Request, done: StepResult) -> EngineOutput:
        """The output of a request the scheduler finished this step."""
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time)
        if req.is_embed:
            if req.req_id in done.errors:
                return EmbeddingOutput(req.req_id, req.prompt_token_ids, torch.empty(0), "error", metrics,
                                       error=done.errors[req.req_id])
            return EmbeddingOutput(req.req_id, req.prompt_token_ids, done.embeddings[req.req_id], metrics=metrics)
        self.continuations.remember(req)
        logprobs = list(req.output_logprobs) if req.sampling_params.logprobs is not None else None
        prompt_logprobs = [None, *req.prompt_logprobs] if req.sampling_params.prompt_logprobs is not None else None
        return GenerationOutput(req.req_id, req.prompt_token_ids, list(req.output_token_ids), req.output_text,
                                req.finish_reason, metrics, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                num_cached_tokens=req.num_cached_tokens)

    def run_until_done(self, max_steps: int | None = None) -> dict[str, EngineOutput]:
        """The engine loop run to empty: step until every request finished; bounded by `max_steps` (default:
        enough for every token)."""
        limit = max_steps if max_steps is not None else 10 + sum(
            r.num_tokens + (r.sampling_params.max_tokens if r.sampling_params else 0)
            for r in self.scheduler.requests.values()) * 4
        from orthrus_rag.engine.loop import EngineLoop

        outputs: dict[str, EngineOutput] = {}
        EngineLoop(self, orphan=lambda o: outputs.update({o.request_id: o} if o.finished else {})).run_until_done(limit)
        return outputs

    # ---- as the deployments (orthrus_rag.engine.deploy) offer it: an in-process engine holds no workers ------
    def shutdown(self) -> None:
        """Nothing to release in-process; lets benchmarks treat an Engine like the multi-process deployments."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """K and V bytes one token takes across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(2 * layer.num_kv_heads * layer.head_dim * itemsize for layer in model.attention_layers)


def _sizes_steps_by_cost(config: EngineConfig) -> bool:
    """`cost_budget`, with None meaning: on CUDA (decode steps have slack), off elsewhere (config/engine.py). A
    latency target that bounds step time (`slo.itl_s`, `slo.embed_p95_s`) turns the step-cost model on too, but
    then only the target bounds steps."""
    if config.scheduler.cost_budget is not None:
        return config.scheduler.cost_budget
    return torch.device(config.model.device).type == "cuda"
