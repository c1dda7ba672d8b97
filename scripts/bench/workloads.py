"""Request generators for the paper's workloads (DESIGN.md, "The paper's workloads"), seeded and scaled down.

Every generator is deterministic in its seed, so every system sees the same requests in the same order.
The paper: inputs of 128 words, generation `max_tokens` 150 at temperature 0.7, 64 clients.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from orthrus_rag.params import PoolingParams, RerankParams, SamplingParams

# NOTE: common one-token English words, so N words stay close to N..1.5N SmolLM2 tokens
VOCAB = ("the river runs past old mills and quiet towns toward a distant grey sea where ships wait for "
         "morning light over stone walls while birds call from high trees above green fields of wheat "
         "that farmers cut each year before cold winds bring rain snow ice dark nights long days warm "
         "bread fresh milk red apples small boats deep water open roads new books wise words").split()


@dataclass(frozen=True)
class Workload:
    """Shape of one request: input length in words and generation settings."""

    words: int = 32  # paper: 128
    max_tokens: int = 32  # paper: 150
    temperature: float = 0.7
    ignore_eos: bool = True  # NOTE: every generation does the same work on every system (no early EOS)
    seed: int = 0
    # lengths drawn uniformly from [1 - spread, 1 + spread] x words / max_tokens (same draws for every system);
    # NOTE: with equal lengths, closed-loop clients started together finish in lock-step waves, and a window
    # then counts whole waves (measured: 64 clients at 1:9 completed exactly 3 x 64 generations in 30 s)
    spread: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.spread < 1.0:
            raise ValueError(f"spread must be in [0, 1), got {self.spread}")

    def draw(self, rng: random.Random, mean: int) -> int:
        if not self.spread:
            return mean
        return max(1, round(mean * rng.uniform(1.0 - self.spread, 1.0 + self.spread)))


@dataclass
class RequestSpec:
    kind: str  # "embed" | "generate" | "score"
    request_id: str
    input: str | tuple[str, tuple[str, ...]]  # a score request: (query, documents), one call scoring them all
    params: SamplingParams | PoolingParams | RerankParams
    arrival_s: float = 0.0  # open loop: offset from the start of the run
    tags: dict[str, object] = field(default_factory=dict)  # e.g. {"phase": 2}


def make_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(words))


def make_request(rng: random.Random, kind: str, request_id: str, w: Workload) -> RequestSpec:
    text = make_text(rng, w.draw(rng, w.words))
    if kind == "embed":
        return RequestSpec(kind, request_id, text, PoolingParams(pooling="mean"))
    params = SamplingParams(max_tokens=w.draw(rng, w.max_tokens), temperature=w.temperature,
                            ignore_eos=w.ignore_eos, seed=rng.randrange(1 << 31))
    return RequestSpec(kind, request_id, text, params)


def make_score_request(rng: random.Random, request_id: str, w: Workload, documents: int) -> RequestSpec:
    """A rerank call as a RAG pipeline makes one: a short query (a quarter of `words`) and `documents` passages of
    `words` each, all scored in one call (its latency is the whole call's)."""
    query = make_text(rng, max(1, w.draw(rng, w.words) // 4))
    docs = tuple(make_text(rng, w.draw(rng, w.words)) for _ in range(documents))
    return RequestSpec("score", request_id, (query, docs), RerankParams())


def mixed_stream(p_embed: float, w: Workload, prefix: str = "r", tags: dict | None = None,
                 ) -> Iterator[RequestSpec]:
    """Endless requests: embedding with probability `p_embed`, else generation (the ratio sweep)."""
    if not 0.0 <= p_embed <= 1.0:
        raise ValueError(f"p_embed must be in [0, 1], got {p_embed}")
    rng = random.Random(f"{w.seed}-{p_embed}-{prefix}")
    i = 0
    while True:
        kind = "embed" if rng.random() < p_embed else "generate"
        req = make_request(rng, kind, f"{prefix}-{i}", w)
        req.tags.update(tags or {})
        yield req
        i += 1


def rerank_stream(p_embed: float, p_score: float, w: Workload, documents: int, prefix: str = "r",
                  ) -> Iterator[RequestSpec]:
    """Endless requests of three kinds: an embedding with probability `p_embed`, a rerank call (`documents`
    passages against one query) with probability `p_score`, else a generation."""
    if not (0.0 <= p_embed and 0.0 <= p_score and p_embed + p_score <= 1.0):
        raise ValueError(f"shares must be non-negative with a sum of at most 1, got embed {p_embed}, score {p_score}")
    if documents < 1:
        raise ValueError(f"documents must be positive, got {documents}")
    rng = random.Random(f"{w.seed}-{p_embed}-{p_score}-{prefix}")
    i = 0
    while True:
        draw, rid = rng.random(), f"{prefix}-{i}"
        if draw < p_score:
            yield make_score_request(rng, rid, w, documents)
        else:
            yield make_request(rng, "embed" if draw < p_score + p_embed else "generate", rid, w)
        i += 1


def fcfs_blocking(num_generate: int, num_embed: int, w: Workload, long_max_tokens: int) -> list[RequestSpec]:
    """The worst case for FCFS: `num_generate` long generations submitted first, then `num_embed` embeddings,
    all at time 0 (paper: 375 x 1024 tokens, then 250)."""
    rng = random.Random(f"{w.seed}-fcfs")
    long = Workload(w.words, long_max_tokens, w.temperature, w.ignore_eos, w.seed, w.spread)
    gens = [make_request(rng, "generate", f"g-{i}", long) for i in range(num_generate)]
    return gens + [make_request(rng, "embed", f"e-{i}", w) for i in range(num_embed)]


def three_phase(per_phase: int, w: Workload, fractions: tuple[float, ...] = (0.1, 0.5, 0.9),
                ) -> list[list[RequestSpec]]:
    """Phases of `per_phase` requests with the given embedding fractions (paper: 250 each, 10/50/90%); the
    driver keeps at most C in flight."""
    phases = []
    for k, frac in enumerate(fractions):
        stream = mixed_stream(frac, w, prefix=f"p{k}", tags={"phase": k})
        phases.append([next(stream) for _ in range(per_phase)])
    return phases


def poisson(rate: float, num_requests: int, p_embed: float, w: Workload) -> list[RequestSpec]:
    """Open-loop arrivals at `rate` requests/s (exponential gaps), kinds as in `mixed_stream`."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = random.Random(f"{w.seed}-poisson-{rate}")
    stream = mixed_stream(p_embed, w, prefix="q")
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        req = next(stream)
        req.arrival_s = t
        out.append(req)
    return out
