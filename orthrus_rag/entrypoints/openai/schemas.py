"""The OpenAI request bodies the server accepts, as pydantic models (the whole schema is validated before any
request reaches the engine), and the response bodies it returns.

Fields the OpenAI API or vLLM's server has but this engine cannot honour (tools, images, penalties, logit bias,
beam search, ...) are accepted by the schema at their defaults and refused by `unsupported()` with a 400 that names
them; vLLM's extra sampling fields the engine does honour (`top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
...) reach `SamplingParams`. Fields no schema knows are let through, as OpenAI-compatible servers do, so newer
clients keep working, but never silently: `ignored()` names them, and the server logs them and answers with an
`X-Ignored-Fields` header."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_INPUTS = 2048  # per request, as OpenAI's embeddings endpoint
MAX_TEXT_CHARS = 1_000_000  # a longer string cannot fit any model here; refuse before tokenizing it
MAX_N = 16
# OpenAI and vLLM take 4 stop sequences; FlashRAG's FLARE sends 22 one-character ones through its OpenAI client:
# this server takes them, still bounded (each is matched against every step's text)
MAX_STOP = 64
MAX_STOP_TOKEN_IDS = 64

Text = str
TokenIds = list[int]


class _Strict(BaseModel):
    # NOTE: NaN and infinity parse from Python's JSON ("NaN", "Infinity"); refuse them at the schema
    # strict: "0.5" is not a number and true is not a count (OpenAI refuses both); an int is still a float
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def ignored(self) -> list[str]:
        """The body's top-level fields this schema does not know (and the server therefore does not act on)."""
        return sorted(self.model_extra or {})


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What completions and chat share."""

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # accepted so that a client's default (0, null) passes; any other value is refused by `unsupported()`
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # output constraints (entrypoints/openai/generation.py): OpenAI's response_format, vLLM's extra fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # close a constrained output as its budget runs out (default on; StructuredOutputsParams.close_on_length)
    structured_close_on_length: bool | None = None
    # vLLM's extra sampling fields that the engine honours (SamplingParams)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    # vLLM's: each choice also carries its prompt's and its output's token ids (what a caller continues from)
    return_token_ids: bool = False
    # ours: seconds the finished generation's KV stays held, so a request continuing its token ids computes only
    # what it appends (SamplingParams.hold_kv_s; engine/continuation.py)
    hold_kv_s: float = Field(0.0, ge=0.0, le=600.0)
    # vLLM's extra fields it cannot honour: accepted at their neutral values, refused by name otherwise
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    length_penalty: float | None = None
    use_beam_search: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # completions only; not with stream
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only matters where special tokens are kept: never here
    truncate_prompt_tokens: int | None = None

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def base_unsupported(self) -> list[str]:
        bad = []
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        if len(self.stop_list()) > MAX_STOP:
            bad.append(f"more than {MAX_STOP} stop sequences")
        neutral = {"min_p": (None, 0.0), "repetition_penalty": (None, 1.0), "length_penalty": (None, 1.0),
                   "use_beam_search": (False,), "allowed_token_ids": (None,), "bad_words": (None, []),
                   "skip_special_tokens": (True,), "truncate_prompt_tokens": (None,)}
        bad.extend(name for name, values in neutral.items() if getattr(self, name) not in values)
        return bad

    def engine_sampling(self) -> dict[str, Any]:
        """vLLM's extra fields as `SamplingParams` keyword arguments."""
        return {"top_k": 0 if self.top_k is None else self.top_k, "min_tokens": self.min_tokens,
                "ignore_eos": self.ignore_eos, "stop_token_ids": list(self.stop_token_ids or ()),
                "include_stop_str_in_output": self.include_stop_str_in_output, "priority": self.priority,
                "prompt_logprobs": self.prompt_logprobs, "hold_kv_s": self.hold_kv_s}


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | TokenIds | list[TokenIds] = Field(...)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = self.base_unsupported()
        if self.echo:
            bad.append("echo")
        if self.suffix:
            bad.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of other than n")
        return bad


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None

    def unsupported(self) -> list[str]:
        bad = self.base_unsupported()
        if self.tools or self.functions:
            bad.append("tools / function calling")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            bad.append("tool_choice")
        if self.audio is not None or (self.modalities and set(self.modalities) - {"text"}):
            bad.append("audio output")
        for m in self.messages:
            if m.role in ("tool", "function"):
                bad.append(f"{m.role} messages")
            if isinstance(m.content, list):
                kinds = {p.type for p in m.content} - {"text"}
                bad.extend(f"{k} content" for k in sorted(kinds))
        if self.top_logprobs is not None and not self.logprobs:
            bad.append("top_logprobs without logprobs=true")
        if self.prompt_logprobs is not None:
            bad.append("prompt_logprobs (on /v1/completions)")
        if self.return_token_ids:
            bad.append("return_token_ids (on /v1/completions)")
        return list(dict.fromkeys(bad))

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(_Strict):
    model: str = Field(min_length=1)
    input: Text | list[Text] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=256)
    # Cohere's and Voyage's field: an embedding adapter with query / document prefixes gets the right one
    input_type: Literal["query", "document"] | None = None
    # vLLM's field: lower runs sooner. Below 0 is latency-critical (what the pipelines send for a hop's query);
    # above 0 is bulk work (documents ingested while serving): scheduled below queries and generations under every
    # policy (scheduler.bulk_step_tokens / bulk_min_tokens), and held to the in-process engine's bulk in-flight limit
    priority: int = 0


# ---- responses -------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "orthrus-rag"
    kinds: list[str] = Field(default_factory=list)  # "generate", "embed", "score": what requests may name it for
    parent: str | None = None  # an adapter's base model (vLLM's field for a LoRA)
    # an embedding adapter's prefixes by input type ("query", "document"), applied by the server for `input_type`
    input_prefixes: dict[str, str] = Field(default_factory=dict)
    # the base model's execution plan: what runs each part of a step (engine/executor/plan.py); None where the
    # engine runs in other processes (a deployment, Ray replicas)
    plan: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
