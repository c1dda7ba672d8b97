"""Model runner: turns a scheduler decision into one flat token batch, runs it, and hands rows out.

Generation rows whose known tokens are all computed go to the sampler; embedding rows go to their request's
incremental pooler. Encoder requests (a separate bidirectional model) run in a second forward in the same
step. The runner never decides who runs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from orthrus_rag.engine.request import Request
from orthrus_rag.engine.scheduler import SchedulerOutput
from orthrus_rag.layers.attention import AttentionMetadata, build_decode_group, build_packed_group
from orthrus_rag.layers.context import ForwardContext, forward_context
from orthrus_rag.layers.pooler import make_pooler_state, pool_whole
from orthrus_rag.layers.sampler import Sampler
from orthrus_rag.models.llama import CausalLM


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # req_id -> new token
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)  # req_id -> pooled result
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why its pooling failed


@dataclass
class _FlatBatch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[torch.Tensor] = field(default_factory=list)
    # per-sequence bookkeeping
    packed: list[tuple[int, int, int, Request]] = field(default_factory=list)  # (seq, start row, n, req)
    decode: list[tuple[int, Request]] = field(default_factory=list)  # (row, req)
    lora_rows: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, encoder: torch.nn.Module | None = None) -> None:
        self.model = model
        self.encoder = encoder
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.windows = {layer.window for layer in model.attention_layers}
        num_slots = num_blocks * block_size
        # NOTE: zeros, not empty: padded decode slots are masked, but 0 * NaN garbage would still be NaN
        self.kv_caches = [
            (torch.zeros((num_slots, layer.num_kv_heads, layer.head_dim), dtype=dtype, device=device),
             torch.zeros((num_slots, layer.num_kv_heads, layer.head_dim), dtype=dtype, device=device))
            for layer in model.attention_layers]

    def _bind_cache(self) -> None:
        """Point the attention layers at this runner's cache (cheap). Engines that share one model object may
        take turns stepping (tests, handoff); they must not step it from two threads at once."""
        for layer, (k, v) in zip(self.model.attention_layers, self.kv_caches):
            layer.k_cache, layer.v_cache = k, v

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

    def _flatten(self, sched: SchedulerOutput) -> _FlatBatch:
        b = _FlatBatch()
        for seq, s in enumerate(sched.scheduled):
            req, n, start = s.req, s.num_new_tokens, len(b.input_ids)
            nc = req.num_computed_tokens
            b.input_ids.extend(req.token_ids_slice(nc, nc + n))
            b.positions.extend(range(nc, nc + n))
            writes = req.needs_kv(n)
            b.slot_mapping.append(self._slots(req, nc, nc + n) if writes else torch.full((n,), -1))
            if n == 1 and writes:
                b.decode.append((start, req))
            else:
                b.packed.append((seq, start, n, req))
            if req.adapter_slot:
                b.lora_rows[req.adapter_slot].extend(range(start, start + n))
        return b

    def _attention_metadata(self, b: _FlatBatch) -> AttentionMetadata:
        dev = self.device
        meta = AttentionMetadata(num_tokens=len(b.input_ids), slot_mapping=torch.cat(b.slot_mapping).to(dev))
        if b.packed:
            rows, q_seq, q_pos, cached_slots, k_seq, k_pos = [], [], [], [], [], []
            for seq, start, n, req in b.packed:
                nc = req.num_computed_tokens
                rows.append(torch.arange(start, start + n))
                q_seq.append(torch.full((n,), seq))
                q_pos.append(torch.arange(nc, nc + n))
                cached_slots.append(self._slots(req, 0, nc))
                k_seq.append(torch.full((nc,), seq))
                k_pos.append(torch.arange(nc))
            meta.packed = build_packed_group(*(torch.cat(x).to(dev) for x in (rows, q_seq, q_pos, cached_slots,
                                                                              k_seq, k_pos)), self.windows)
        if b.decode:
            seq_lens = torch.tensor([req.num_computed_tokens + 1 for _, req in b.decode])
            width = int(seq_lens.max())
            tables = torch.zeros((len(b.decode), -(-width // self.block_size)), dtype=torch.long)
            for i, (_, req) in enumerate(b.decode):
                tables[i, :len(req.block_table)] = torch.tensor(req.block_table, dtype=torch.long)
            pos = torch.arange(width)
            # padding positions map to some valid slot; the mask hides them
            slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
            meta.decode = build_decode_group(torch.tensor([r for r, _ in b.decode], device=dev), slots.to(dev),
                                             seq_lens.to(dev), self.windows)
        return meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        if sched.scheduled:
            self._run_decoder(sched, out)
        if sched.encoder:
            self._run_encoder(sched.encoder, out)
        return out

    def _run_decoder(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        b = self._flatten(sched)
        ctx = ForwardContext(attn=self._attention_metadata(b), lora_rows=[
            (slot, torch.tensor(rows, dtype=torch.long, device=self.device)) for slot, rows in b.lora_rows.items()])
        self._bind_cache()
        input_ids = torch.tensor(b.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(b.positions, dtype=torch.long, device=self.device)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        # generation rows: the last row of every request whose known tokens are now all computed
        sample_rows, sample_reqs = [], []
        start = 0
        for s in sched.scheduled:
            req, n = s.req, s.num_new_tokens
            if req.is_embed:
                self._pool(req, hidden[start:start + n], positions[start:start + n], n, out)
            elif req.num_computed_tokens + n == req.num_tokens:
                sample_rows.append(start + n - 1)
                sample_reqs.append(req)
            start += n
        if sample_reqs:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            tokens = self.sampler(logits, [r.sampling_params for r in sample_reqs],
                                  [r.generator for r in sample_reqs]).tolist()
            out.sampled.update((r.req_id, tok) for r, tok in zip(sample_reqs, tokens))

    def _pool(self, req: Request, hidden: torch.Tensor, positions: torch.Tensor, n: int, out: RunnerOutput) -> None:
        if req.pooler_state is None:
            req.pooler_state = make_pooler_state(req.pooling_params, req.num_tokens)
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
        assert self.encoder is not None, "encoder requests without an encoder model"
        ids = [tok for r in reqs for tok in r.prompt_token_ids]
        positions = [p for r in reqs for p in range(r.num_tokens)]
        seq_lens = [r.num_tokens for r in reqs]
        hidden = self.encoder(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                              seq_lens)
        start = 0
        for req, n in zip(reqs, seq_lens):
            self._finish_pool(req, lambda h=hidden[start:start + n], r=req: pool_whole(h, r.pooling_params), out)
            start += n
