"""The engine's configuration as plain dataclasses. They import no Hydra, yet they are the CLI's config nodes
(`model`, `cache`, `scheduler` of config/app.py's AppConf): every field is a CLI key by its own name, and the
`__post_init__` checks below are the rules the CLI reports at compose time."""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch

from orthrus_rag.config.kernels import QUANTIZATIONS, check_kernels, requested

ADAPTER_KINDS = ("generate", "embed", "both")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class ModelConfig:
    """Which weights to run. `name` is a built-in name, a local folder, a GGUF file or a hub id."""

    name: str = "smollm2-135m-instruct"  # a built-in name, a local folder, a GGUF file or a hub id
    embedding_adapters: list[str] = field(default_factory=list)  # PEFT folders; the first is the default
    # named PEFT LoRA folders ({name: path}) that requests address by name (SamplingParams.adapter,
    # PoolingParams.adapter, or the API's `model`); each may generate and embed unless `adapter_kinds` says
    # one ("generate" | "embed" | "both")
    adapters: dict[str, str] = field(default_factory=dict)
    adapter_kinds: dict[str, str] = field(default_factory=dict)
    embedding_model: str | None = None  # a separate bidirectional encoder (e.g. "all-minilm-l6-v2")
    # rerankers that score (query, document) pairs in the same steps (engine/rerankers.py), by name: a BERT-family
    # *ForSequenceClassification cross-encoder (folder, built-in name or hub id), or "backbone" / "backbone+ADAPTER"
    # (the generation backbone's yes/no reading, under a loaded adapter or none); the first is the default
    rerankers: list[str] = field(default_factory=list)
    # "auto": bfloat16 on CUDA and on CPUs with bf16 dot products (AVX512-BF16 / AMX: 3-4x fp32's GEMMs there),
    # float32 on other CPUs; norms, rotary, softmax, logits, sampling and pooling sums run in fp32 either way
    dtype: str = "auto"
    device: str = "cpu"  # cpu | cuda (cuda:N)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # which implementation runs each part of a step: "auto" (the fastest this machine runs, per part) or "torch"
    # (torch's own ops everywhere: the reference); `orthrus-rag plan` prints what a config gets (config/kernels.py)
    kernels: str = "auto"
    # single parts pinned, for tests and benchmarks: {part: choice}, e.g. {decode_attention: sdpa, layers: fused};
    # parts and choices: config/kernels.py PARTS (layers, linears, attention, decode_attention, prefill_attention,
    # encoder_attention, lora, sampler, cuda_graphs)
    kernel_overrides: dict[str, str] = field(default_factory=dict)
    # the decoder's linear weights stored quantized on the CPU, the activations in `dtype`: "none", "int8" (one
    # scale per output row), "int4" (a scale and a zero per 32 inputs) or "auto" (a quantized GGUF's own form,
    # else none); a step reads half or a quarter of the weight bytes, what decoding a few sequences is bound by
    # (layers/quantized.py)
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected auto or one of {', '.join(_DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; expected one of "
                             f"{', '.join(QUANTIZATIONS)}")
        self.kernel_overrides = dict(self.kernel_overrides)
        check_kernels(self.kernels, self.kernel_overrides)
        self.adapters, self.adapter_kinds = dict(self.adapters), dict(self.adapter_kinds)
        for name, kind in self.adapter_kinds.items():
            if name not in self.adapters:
                raise ValueError(f"adapter_kinds names {name!r}, which is not in adapters "
                                 f"({', '.join(sorted(self.adapters)) or 'none'})")
            if kind not in ADAPTER_KINDS:
                raise ValueError(f"adapter {name!r}: unknown kind {kind!r}; expected {', '.join(ADAPTER_KINDS)}")
        if any(not name for name in self.adapters):
            raise ValueError("an adapter needs a non-empty name")
        # NOTE: one name given alone is one reranker, not its letters
        self.rerankers = [self.rerankers] if isinstance(self.rerankers, str) else [str(r) for r in self.rerankers]
        if any(not r.strip() for r in self.rerankers) or len(set(self.rerankers)) < len(self.rerankers):
            raise ValueError(f"rerankers must be distinct, non-empty names; got {self.rerankers}")
        loaded = self.loaded_adapters()
        for r in self.rerankers:
            base, plus, adapter = r.partition("+")
            if base == "backbone" and plus and adapter not in loaded:
                raise ValueError(f"reranker {r!r} names adapter {adapter!r}, which is not loaded (model.adapters or "
                                 f"model.embedding_adapters: {', '.join(loaded) or 'none'})")

    def adapter_kind(self, name: str) -> str:
        """What a named adapter may do: "generate", "embed" or "both" (a plain PEFT folder may do both)."""
        return self.adapter_kinds.get(name, "both")

    def loaded_adapters(self) -> dict[str, tuple[str, str]]:
        """Every adapter the engine loads, in slot order: name -> (folder, kind). The embedding adapters come
        first, named by their folders and of kind "embed" (the first is the default embedding); then the named
        ones. The one owner of these names: loading attaches them, the CLI checks what a run names against them."""
        from pathlib import Path

        out = {Path(p).name: (p, "embed") for p in self.embedding_adapters}
        out.update((name, (p, self.adapter_kind(name))) for name, p in self.adapters.items())
        return out

    def requested_kernels(self) -> dict[str, str]:
        """Each part's requested implementation (config/kernels.py); the plan resolves `auto` at load."""
        return requested(self.kernels, self.kernel_overrides)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            from orthrus_rag.machine import has_native_bf16

            native = torch.device(self.device).type == "cuda" or has_native_bf16()
            return torch.bfloat16 if native else torch.float32
        return _DTYPES[self.dtype]


@dataclass
class CacheConfig:
    """Paged KV cache size: `num_blocks` blocks of `block_size` tokens, or (when num_blocks is None) as many
    blocks as fit in `kv_cache_gib` of memory."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; None: as many as fit in kv_cache_gib
    kv_cache_gib: float = 1.0  # memory for the KV cache when num_blocks is None
    enable_prefix_caching: bool = True  # share the KV blocks of common prompt prefixes (engine/core/block_manager.py)

    def __post_init__(self) -> None:
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError("block_size and num_blocks must be positive")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")

    def resolve_num_blocks(self, bytes_per_token: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, int(self.kv_cache_gib * (1 << 30)) // (bytes_per_token * self.block_size))


@dataclass
class SloConfig:
    """Per-kind latency targets for the orthrus policy (engine/core/slo.py); each None: no target of that kind.

    `itl_s` bounds a decode's inter-token time: a step that carries decodes takes only the prompt and embedding
    work the step-cost model predicts to fit in it (on every device). `generate_p95_s` / `embed_p95_s` are
    end-to-end targets: a waiting or part-done request of that kind that has waited `risk_fraction` of its target
    is at risk, and its kind gets the step's residual budget first (the other kind keeps its `min_share`). When
    no target is at risk the remaining-token split decides, as without targets. `embed_p95_s` also holds every
    step's predicted time to half of it (engine/core/slo.py), and with `yield_decodes` a decode may sit out one
    step so that an embedding at risk fits in that bound (never two steps running, never past `itl_s`).
    `embed_p95_s="auto"` sets the target itself: `auto_multiple` times an embedding's own unloaded latency on this
    machine, as the step-cost model predicts it (calibrated at start-up, refitted from every step)."""

    itl_s: float | None = None  # a decode's inter-token time at most (seconds)
    generate_p95_s: float | None = None  # a generation's end-to-end target (seconds)
    # NOTE: int in the union too: OmegaConf does not widen a whole number to float inside a Union (`embed_p95_s=1`)
    embed_p95_s: float | int | str | None = None  # an embedding's end-to-end target (seconds), or "auto"
    # "auto": the target is this many times an embedding's unloaded latency (a step of that embedding alone)
    auto_multiple: float = 8.0
    risk_fraction: float = 0.5  # share of its target a request may wait before its kind goes first
    yield_decodes: bool = True  # a decode may sit out one step for an embedding at risk

    def __post_init__(self) -> None:
        for name in ("itl_s", "generate_p95_s", "embed_p95_s"):
            value = getattr(self, name)
            if name == "embed_p95_s" and isinstance(value, str):
                if value != "auto":
                    raise ValueError(f"slo.embed_p95_s must be a positive number of seconds or 'auto', got {value!r}")
                continue
            if value is not None and (isinstance(value, (str, bool)) or not value > 0):
                raise ValueError(f"slo.{name} must be a positive number of seconds, got {value!r}")
        if not self.auto_multiple > 1.0:
            raise ValueError(f"slo.auto_multiple must be above 1 (the target is that many unloaded latencies), got "
                             f"{self.auto_multiple}")
        if not 0.0 < self.risk_fraction <= 1.0:
            raise ValueError(f"slo.risk_fraction must be in (0, 1], got {self.risk_fraction}")

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.itl_s, self.generate_p95_s, self.embed_p95_s))

    @property
    def bounds_step_time(self) -> bool:
        """Whether a target sizes steps by predicted time (the step-cost model must be on)."""
        return self.itl_s is not None or self.embed_p95_s is not None


@dataclass
class SchedulerConfig:
    """Token budget per step and the policy that shares it."""

    # token budget of one step: bounds a decode's inter-token time while serving; an offline run gains from more
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64  # requests in one step at most
    max_chunk_tokens: int = 256  # caps one request's chunk: bounds step latency
    policy: str = "orthrus"  # a name in engine/core/policies.py POLICIES
    min_share: float = 0.1  # orthrus: least share of the residual budget for a non-empty kind
    encoder_token_weight: float = 0.25  # budget cost of one encoder token relative to one decoder token
    # orthrus: size steps that carry decodes by predicted time (engine/core/step_cost.py) rather than by tokens alone:
    # at most `step_time_target` seconds, or (None) the decodes' own time x (1 + step_time_margin); a step
    # always has room for `min_step_tokens` and never more than max_num_batched_tokens.
    # None (auto): on CUDA, where a decode step's weights reads leave slack for other rows; off on CPU, where a
    # step's time grows with every token (no slack: measured, the cap only cost throughput; docs/design/cost-model.md)
    cost_budget: bool | None = None
    step_time_target: float | None = None  # seconds a step with decodes may take; None: by step_time_margin
    step_time_margin: float = 1.0  # with no target: a step may take the decodes' own time x (1 + this)
    min_step_tokens: int = 32  # tokens a cost-sized step always has room for
    # bulk work (priority > 0: documents ingested while serving) beside serving work in a step: at most this many
    # budget tokens of it (the first bulk encoder input may overdraw it, as a lane's first may); None: all the
    # budget serving leaves. A step without serving work gives bulk the whole budget either way.
    bulk_step_tokens: int | None = None
    # the floor beside the cap: each step with bulk work pending reserves up to this many budget tokens for it before
    # the serving lanes fill theirs (decodes still first). 0: bulk takes only what serving leaves, which a saturating
    # serving load leaves next to nothing of (docs/benchmarks/ingest.md); >0: an ingest progresses at a known rate
    # while serving pays for it in step time and budget
    bulk_min_tokens: int = 0
    slo: SloConfig = field(default_factory=SloConfig)  # per-kind latency targets (orthrus policy)

    def __post_init__(self) -> None:
        if isinstance(self.slo, dict):  # NOTE: options by name (config/build.py) and plain dict nodes give a dict
            self.slo = SloConfig(**self.slo)
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_chunk_tokens < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and max_chunk_tokens must be positive")
        if self.encoder_token_weight <= 0:
            raise ValueError("encoder_token_weight must be positive")
        if self.step_time_target is not None and not self.step_time_target > 0:
            raise ValueError(f"step_time_target must be a positive number of seconds, got {self.step_time_target}")
        if self.bulk_step_tokens is not None and self.bulk_step_tokens < 1:
            raise ValueError(f"bulk_step_tokens must be at least 1 (or None), got {self.bulk_step_tokens}")
        if not 0 <= self.bulk_min_tokens <= min(self.max_num_batched_tokens, self.bulk_step_tokens or math.inf):
            raise ValueError(f"bulk_min_tokens must be in [0, min(max_num_batched_tokens, bulk_step_tokens)], got "
                             f"{self.bulk_min_tokens}")
        if not self.step_time_margin >= 0 or self.min_step_tokens < 1:
            raise ValueError("step_time_margin must be >= 0 and min_step_tokens >= 1")
        if not 0.0 <= self.min_share <= 0.5:
            raise ValueError(f"min_share must be in [0, 0.5], got {self.min_share}")
        if self.slo.is_set and self.policy != "orthrus":
            raise ValueError(f"slo targets are the orthrus policy's; policy {self.policy!r} keeps its published rule")
        if self.slo.bounds_step_time and self.cost_budget is False:
            raise ValueError("slo.itl_s and slo.embed_p95_s size steps by the step-cost model, which "
                             "cost_budget=false turns off")
        # NOTE: the policy name is checked by the registry that owns the names (engine/core/policies.py
        # check_policy, called where an EngineConfig is made: config/build.py), so this module imports nothing of
        # the engine


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    seed: int = 0
