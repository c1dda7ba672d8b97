"""Model runner: turns a scheduler decision into one flat token batch, runs it, and hands rows out.

Generation rows whose known tokens are all computed go to the sampler; embedding rows go to their request's
incremental pooler. Encoder requests (a separate bidirectional model) run in a second forward in the same
step. The runner never decides who runs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from orthrus_rag.config import EngineConfig
from orthrus_rag.engine.core.request import Request
from orthrus_rag.engine.core.step_output import SchedulerOutput
from orthrus_rag.engine.executor.cuda_graphs import DecodeGraphs
from orthrus_rag.engine.executor.plan import (choose_attention, choose_cuda_graphs, choose_decode, choose_prefill,
                                               choose_sampler)
from orthrus_rag.layers.attention import AttentionMetadata, build_metadata
from orthrus_rag.layers.context import ForwardContext, forward_context
from orthrus_rag.layers.lora import flat_lora_rows
from orthrus_rag.layers.pooler import make_pooler_state, pool_whole
from orthrus_rag.layers.sampler import Sampler, hold_tokens, token_logprobs
from orthrus_rag.structured.bitmask import MaskFiller, advance, constrain
from orthrus_rag.outputs import TokenLogprob
from orthrus_rag.models.llama import CausalLM


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # req_id -> new token
    # req_id -> (the first prompt position scored, a TokenLogprob per position from it): SamplingParams.prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # req_id -> its new token's, if asked for
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)  # req_id -> pooled result
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why its pooling failed
    # what ran, as executed (not as scheduled): rows of each kind in the one decoder forward, encoder rows
    num_decoder_forwards: int = 0
    num_embed_rows: int = 0
    num_generate_rows: int = 0
    num_encoder_rows: int = 0
    num_sampled_rows: int = 0
    num_constrained_rows: int = 0  # sampled rows a grammar masked (structured outputs)
    num_adapter_generate_rows: int = 0  # generation rows under a LoRA adapter
    num_adapter_embed_rows: int = 0  # embedding rows under a LoRA adapter
    num_adapters: int = 0  # distinct adapters with rows in the forward
    seconds: float | None = None  # the step's time on the device (`run_timed` below): what the cost model fits


PROMPT_LOGITS_ROWS = 256  # prompt rows turned into logits at a time (prompt log-probabilities)


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, num_blocks: int, dtype: torch.dtype,
                 encoder: torch.nn.Module | None = None, max_seq_len: int = 0,
                 eos_token_ids: Collection[int] = (), cross_encoders: Mapping[str, torch.nn.Module] | None = None,
                 ) -> None:
        """`num_blocks` KV blocks of `config.cache.block_size` tokens in `dtype` (the model's); attention, sampler and
        CUDA graphs as the execution plan chooses them for `config.model`'s kernels (engine/executor/plan.py); steps
        of at most `config.scheduler`'s token budget. `encoder`: the embedding model; `cross_encoders`: rerankers
        by name, run as encoders too (a request's `encoder` names its model)."""
        want, device = config.model.requested_kernels(), torch.device(config.model.device)
        block_size, max_num_batched_tokens = config.cache.block_size, config.scheduler.max_num_batched_tokens
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)  # what a generation short of its min_tokens may not sample
        # what a constrained row whose grammar allows nothing is left with
        self.eos_token_id = min(self.eos_token_ids) if self.eos_token_ids else None
        self.vocab_size = int(model.lm_head.weight.shape[0])  # the logits' width (the grammar masks')
        self.masks = MaskFiller()
        self.encoder = encoder
        self.encoders = {**({"": encoder} if encoder is not None else {}), **(cross_encoders or {})}
        self.block_size = block_size
        self.device = device
        # NOTE: asking for the sampler builds the extension here, at start-up, not in the first sampled step
        self.sampler = Sampler(use_kernel=choose_sampler(want["sampler"], device) == "cpp")
        self.windows = {layer.window for layer in model.attention_layers}
        head_dim = model.attention_layers[0].head_dim
        self.attn_backend = choose_attention(want["attention"], device, dtype, head_dim)
        self.num_slots = num_blocks * block_size
        # NOTE: rows past the paged region take the K/V of tokens the cache does not keep (an embedding's final
        # chunk), one per token of a step, so attention reads every key from the cache (layers/context.py)
        self.max_num_batched_tokens = max_num_batched_tokens
        rows = self.num_slots + max_num_batched_tokens
        # NOTE: zeros, not empty: padded key positions are masked, but 0 * NaN garbage would still be NaN
        self.kv_caches = [
            (torch.zeros((rows, layer.num_kv_heads, layer.head_dim), dtype=dtype, device=device),
             torch.zeros((rows, layer.num_kv_heads, layer.head_dim), dtype=dtype, device=device))
            for layer in model.attention_layers]
        # CPU: decodes read the paged cache in a C++ kernel, and prompt and embedding chunks attend in one
        # (attention/cpu_kernels.py, attention/cpu_prefill.py), where the plan takes them
        self.decode_kernel = choose_decode(want["decode_attention"], device, dtype, self.attn_backend) == "cpp"
        self.prefill_kernel = choose_prefill(want["prefill_attention"], device, dtype, head_dim,
                                             self.attn_backend) == "cpp"
        self.decode_graphs: DecodeGraphs | None = None  # decode-only steps replayed as CUDA graphs
        if choose_cuda_graphs(want["cuda_graphs"], device) == "on":
            self.decode_graphs = DecodeGraphs(model, self.kv_caches, self.windows, self.num_slots,
                                              min(max_num_batched_tokens, 512), max_seq_len, device)

    def _slots(self, req: Request, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) of `req` (vectorised: contexts can be thousands long)."""
        pos = torch.arange(start, end)
        table = torch.tensor(req.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def read_kv(self, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy of K and V of `req`'s computed tokens: each [num_layers, num_tokens, kv_heads, head_dim], CPU."""
        slots = self._slots(req, 0, req.num_computed_tokens).to(self.device)
        return (torch.stack([k[slots] for k, _ in self.kv_caches]).cpu(),
                torch.stack([v[slots] for _, v in self.kv_caches]).cpu())

    def write_kv(self, req: Request, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V (as `read_kv` returns them) into `req`'s slots for its computed tokens."""
        expected = (len(self.kv_caches), req.num_computed_tokens, *self.kv_caches[0][0].shape[1:])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"KV of shape {tuple(k.shape)} / {tuple(v.shape)} does not fit this model's cache: "
                             f"expected {expected}")
        slots = self._slots(req, 0, req.num_computed_tokens).to(self.device)
        for i, (k_cache, v_cache) in enumerate(self.kv_caches):
            k_cache[slots] = k[i].to(device=self.device, dtype=k_cache.dtype)
            v_cache[slots] = v[i].to(device=self.device, dtype=v_cache.dtype)

    def _prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, list]:
        """The flat batch's token ids, the step's attention metadata and LoRA rows; host work per request is list
        appends only."""
        ids: list[int] = []
        query_lens, context_lens, tables, keeps = [], [], [], []
        lora_rows: dict[int, list[range]] = defaultdict(list)
        for s in sched.scheduled:
            req, n = s.req, s.num_new_tokens
            nc = req.num_computed_tokens
            if req.adapter_slot:
                lora_rows[req.adapter_slot].append(range(len(ids), len(ids) + n))
            ids.extend(req.token_ids_slice(nc, nc + n))
            query_lens.append(n)
            context_lens.append(nc)
            tables.append(req.block_table)
            keeps.append(req.needs_kv(n))
        if len(ids) > self.max_num_batched_tokens:
            raise ValueError(f"a step of {len(ids)} tokens exceeds the runner's {self.max_num_batched_tokens} "
                             "(max_num_batched_tokens)")
        meta = build_metadata(query_lens, context_lens, tables, keeps, self.block_size, self.num_slots, self.device)
        meta.decode_kernel = self.decode_kernel
        meta.prefill_kernel = self.prefill_kernel
        lora = [(slot, torch.tensor([r for rng in ranges for r in rng], dtype=torch.long, device=self.device))
                for slot, ranges in sorted(lora_rows.items())]
        return torch.tensor(ids, dtype=torch.long, device=self.device), meta, lora

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, lora: list) -> torch.Tensor:
        """One decoder forward: a captured decode graph where one fits, else eager with the attention backend's
        plan (built once here, reused by every layer)."""
        if self.decode_graphs is not None and self.decode_graphs.eligible(meta, bool(lora)):
            return self.decode_graphs.run(input_ids, meta)
        meta.plan = self.attn_backend.plan(meta, self.windows)
        ctx = ForwardContext(attn=meta, attn_backend=self.attn_backend, kv_caches=self.kv_caches, lora_rows=lora,
                             lora_flat=flat_lora_rows(lora) if len(lora) > 1 else None)
        with forward_context(ctx):
            return self.model(input_ids, meta.positions)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step; its `seconds` are measured on the device (synchronised on CUDA)."""
        out = RunnerOutput()
        _, out.seconds = run_timed(self.device, lambda: self._run(sched, out))
        return out

    def _run(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        if sched.scheduled:
            self._run_decoder(sched, out)
        if sched.encoder:
            self._run_encoder(sched.encoder, out)

    def _run_decoder(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        input_ids, meta, lora = self._prepare(sched)
        positions = meta.positions
        # generation rows: the last row of every request whose known tokens are all computed after this step
        sample_rows, sample_reqs = [], []
        start = 0
        for s in sched.scheduled:
            req, n = s.req, s.num_new_tokens
            if not req.is_embed and req.num_computed_tokens + n == req.num_tokens:
                sample_rows.append(start + n - 1)
                sample_reqs.append(req)
            start += n
        grammars = [r.grammar for r in sample_reqs]
        constrained = any(g is not None for g in grammars)  # NOTE: a step without grammars never enters structured/
        masks = self.masks.start(grammars, self.vocab_size) if constrained else None  # filled while the forward runs
        hidden = self._forward(input_ids, meta, lora)
        out.num_decoder_forwards += 1
        out.num_adapters = len(lora)
        start = 0
        for s in sched.scheduled:
            req, n = s.req, s.num_new_tokens
            if req.is_embed:
                out.num_embed_rows += n
                out.num_adapter_embed_rows += n if req.adapter_slot else 0
                self._pool(req, hidden[start:start + n], positions[start:start + n], n, out)
            else:
                out.num_generate_rows += n
                out.num_adapter_generate_rows += n if req.adapter_slot else 0
                if req.sampling_params.prompt_logprobs is not None:
                    self._prompt_logprobs(req, hidden[start:start + n], out)
            start += n
        if sample_reqs:
            rows = torch.tensor(sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            out.num_sampled_rows = len(grammars)
            out.num_constrained_rows = sum(g is not None for g in grammars)
            allowed = logits
            if constrained:
                keep_raw = any(r.grammar is not None and r.sampling_params.logprobs is not None for r in sample_reqs)
                allowed = constrain(logits, grammars, self.eos_token_id, keep_raw,
                                    masks.result() if masks is not None else None)
            held = {i: r.sampling_params.held_token_ids(self.eos_token_ids) for i, r in enumerate(sample_reqs)
                    if len(r.output_token_ids) < r.sampling_params.min_tokens}
            if held:
                allowed = hold_tokens(allowed, held)
            sampled = self.sampler(allowed, [r.sampling_params for r in sample_reqs], [r.rng for r in sample_reqs])
            drawn = sampled.tolist()
            tokens = advance(grammars, drawn) if constrained else drawn
            if tokens != drawn:  # a grammar closed its output within its budget (structured/budget.py)
                sampled = torch.tensor(tokens, dtype=sampled.dtype, device=sampled.device)
            out.sampled.update((r.req_id, tok) for r, tok in zip(sample_reqs, tokens))
            self._logprobs(logits, sampled, sample_reqs, out)

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, reqs: list[Request], out: RunnerOutput) -> None:
        """The sampled tokens' log-probabilities for the rows that asked, from the logits that sampled them."""
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        top_k = max(reqs[i].sampling_params.logprobs for i in rows)
        chosen, top = token_logprobs(logits.index_select(0, index), sampled.index_select(0, index), top_k)
        for i, lp, best in zip(rows, chosen, top):
            req = reqs[i]
            out.logprobs[req.req_id] = TokenLogprob(int(sampled[i]), lp, best[:req.sampling_params.logprobs])

    def _prompt_logprobs(self, req: Request, hidden: torch.Tensor, out: RunnerOutput) -> None:
        """Each prompt token's log-probability given the ones before it, from this chunk's rows: row j (position
        p) predicts the token at p + 1 while that is a prompt token. Logits are taken `PROMPT_LOGITS_ROWS` rows at
        a time, so a long chunk never holds [rows, vocabulary] in fp32 at once."""
        first = req.num_computed_tokens  # this chunk's first position
        rows = min(hidden.shape[0], req.num_prompt_tokens - 1 - first)
        if rows <= 0:
            return
        k = req.sampling_params.prompt_logprobs
        targets = torch.tensor(req.prompt_token_ids[first + 1:first + 1 + rows], device=hidden.device)
        scored: list[TokenLogprob] = []
        for a in range(0, rows, PROMPT_LOGITS_ROWS):
            b = min(a + PROMPT_LOGITS_ROWS, rows)
            logits = self.model.compute_logits(hidden[a:b])
            chosen, top = token_logprobs(logits, targets[a:b], k)
            ranks = (torch.log_softmax(logits.float(), dim=-1) > torch.tensor(chosen, device=logits.device)[:, None])
            for t, lp, best, rank in zip(targets[a:b].tolist(), chosen, top, (ranks.sum(1) + 1).tolist()):
                scored.append(TokenLogprob(t, lp, best, rank))
        out.prompt_logprobs[req.req_id] = (first + 1, scored)

    def _pool(self, req: Request, hidden: torch.Tensor, positions: torch.Tensor, n: int, out: RunnerOutput) -> None:
        if req.pooler_state is None:  # NOTE: a scored pair may start past a prefix the cache served
            req.pooler_state = make_pooler_state(req.pooling_params, req.num_tokens, req.num_computed_tokens)
        req.pooler_state.update(hidden, positions)
        if req.num_computed_tokens + n == req.num_tokens:
            self._finish_pool(req, req.pooler_state.finish, out)

    @staticmethod
    def _finish_pool(req: Request, pool: Callable[[], torch.Tensor], out: RunnerOutput) -> None:
        try:
            out.embeddings[req.req_id] = pool()
        except Exception as exc:  # NOTE: a caller's pooling head must not fail the other requests of the step
            out.errors[req.req_id] = f"{type(exc).__name__}: {exc}"

    def _run_encoder(self, reqs: list[Request], out: RunnerOutput) -> None:
        """One packed forward per encoder the step's encoder requests name (the embedding model, rerankers)."""
        groups: dict[str, list[Request]] = defaultdict(list)
        for req in reqs:
            groups[req.encoder].append(req)
        for name, group in groups.items():
            encoder = self.encoders.get(name)
            assert encoder is not None, f"encoder requests for {name or 'the embedding model'!r}, which is not loaded"
            ids = [tok for r in group for tok in r.prompt_token_ids]
            positions = [p for r in group for p in range(r.num_tokens)]
            seq_lens = [r.num_tokens for r in group]
            types = None
            if any(r.token_type_ids is not None for r in group):
                types = torch.tensor([t for r in group for t in (r.token_type_ids or [0] * r.num_tokens)],
                                     device=self.device)
            hidden = encoder(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                             seq_lens, types)
            out.num_encoder_rows += len(ids)
            start = 0
            for req, n in zip(group, seq_lens):
                self._finish_pool(req, lambda h=hidden[start:start + n], r=req: pool_whole(h, r.pooling_params), out)
                start += n


T = TypeVar("T")


# How long one runner step takes on its device: what the step-cost model (engine/core/step_cost.py) learns from.
#
# CUDA runs kernels asynchronously, so a host clock read when a step's launches return measures launch time, not
# step time: an embedding-only step returns before its GEMMs finish (calibration is made of such steps). On CUDA a
# step is therefore bracketed by two CUDA events on the device's current stream and the end event is waited for;
# the wait sits at the step boundary, where a step that samples tokens synchronises anyway (`.tolist()`). On
# other devices execution is synchronous and the host clock is the step time.
def run_timed(device: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """`fn()` and the seconds it took on `device` (CUDA: event to event, the end waited for)."""
    if device.type != "cuda":
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start
    stream = torch.cuda.current_stream(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(stream)
    result = fn()
    end.record(stream)
    end.synchronize()  # NOTE: elapsed_time needs both events completed; this is the step-boundary sync
    return result, begin.elapsed_time(end) / 1e3
