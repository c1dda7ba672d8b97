"""A peer (scripts/peers/: vLLM or transformers) as an `EngineClient`: `PeerClient` gives it the submit / poll
shape of a deployment, and the `DeploymentClient` that owns it serves the load drivers and the pipelines.

Peers take plain dicts of vLLM-style fields and report completions as dicts; the drivers want
`GenerationOutput` / `EmbeddingOutput`. Only what the drivers read is filled in (request id, the number of
generated tokens, an error); a completion's time is when `poll` returns it, as for every other system.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput, TokenLogprob
from orthrus_rag.params import PoolingParams, SamplingParams

PEERS = ("vllm", "hf", "llamacpp")
PEERS_DIR = Path(__file__).resolve().parents[1] / "peers"


def sampling_dict(params: SamplingParams | PoolingParams | None) -> dict[str, Any]:
    """The fields both peers understand (vLLM SamplingParams names); pooling requests take the peer's default."""
    if not isinstance(params, SamplingParams):
        return {}
    out: dict[str, Any] = {"max_tokens": params.max_tokens, "temperature": params.temperature,
                           "ignore_eos": params.ignore_eos}
    if params.seed is not None:
        out["seed"] = params.seed
    # NOTE: what the iterative methods ask: a sentence ends at a new line, and FLARE reads each sampled
    # token's logprob; a peer that ignored them would generate (and be timed on) different work
    if params.stop:
        out["stop"] = list(params.stop)
    if params.include_stop_str_in_output:  # NOTE: reasoning search keeps its </search> in the round's text
        out["include_stop_str_in_output"] = True
    if params.logprobs is not None:
        out["logprobs"] = params.logprobs
    if params.structured_outputs is not None:  # NOTE: vLLM's StructuredOutputsParams fields (the peer builds it)
        out["structured_outputs"] = params.structured_outputs.as_request()
    return out


def peer_request(kind: str, text: str, params: SamplingParams | PoolingParams | None,
                 return_embeddings: bool) -> tuple[str, dict[str, Any]]:
    """What a peer is sent for one request. An embedding's instruction is put before its text here (the peers
    take plain text); its pooling is the peer's own (mean + L2 for SmolLM2, the model's for MiniLM)."""
    fields = sampling_dict(params)
    if kind == "embed":
        if isinstance(params, PoolingParams):
            text = (params.instruction or "") + text
            if params.truncate:
                fields["truncate"] = True
        if return_embeddings:
            fields["return_embedding"] = True
    return text, fields


def to_output(d: dict[str, Any]) -> GenerationOutput | EmbeddingOutput:
    """A peer's completion dict as this project's output (what the drivers and the bridge read)."""
    rid, err = d["request_id"], d.get("error")
    if d["kind"] == "generate":
        # NOTE: the drivers count generated tokens; the ids come back only where logprobs were asked (FLARE)
        ids = d.get("token_ids") or [0] * int(d.get("n_tokens", 0))
        logprobs = ([TokenLogprob(int(t), float(lp), []) for t, lp in d["logprobs"]]
                    if d.get("logprobs") is not None else None)
        # NOTE: the prompt's length and its prefix-cache hits, where the peer says (vLLM): prefill per question
        return GenerationOutput(rid, [0] * int(d.get("prompt_tokens", 0)), ids, err or d.get("text", ""),
                                "error" if err else "length", logprobs=logprobs,
                                num_cached_tokens=int(d.get("cached_tokens") or 0))
    import torch

    vector = torch.tensor(d["embedding"], dtype=torch.float32) if "embedding" in d else torch.empty(0)
    return EmbeddingOutput(rid, [], vector, "error" if err else "stop", error=err)


class PeerClient:
    """Wraps a `VllmDedicatedPeer` or `HfPeer` (anything with submit(kind, id, text, dict) / poll / shutdown).

    `return_embeddings`: bring the vectors back (retrieval needs them; the load drivers only count requests)."""

    def __init__(self, peer: Any, return_embeddings: bool = False) -> None:
        self.peer = peer
        self.return_embeddings = return_embeddings

    def submit(self, kind: str, request_id: str, input: str | Sequence[int],
               params: SamplingParams | PoolingParams | None) -> None:
        if not isinstance(input, str):
            raise TypeError("peers take text inputs only")
        text, fields = peer_request(kind, input, params, self.return_embeddings)
        self.peer.submit(kind, request_id, text, fields)

    def poll(self, timeout_s: float) -> list[GenerationOutput | EmbeddingOutput]:
        return [to_output(d) for d in self.peer.poll(timeout_s)]

    def shutdown(self) -> None:
        self.peer.shutdown()


def make_peer(name: str, embed_model: str = "smollm2-135m-instruct", temperature: float = 0.7,
              return_embeddings: bool = False, **kwargs: Any) -> PeerClient:
    """`vllm`: two vLLM engines, one core each (needs the peers venv); `hf`: transformers continuous batching +
    a padded-batch embedder, one thread each; `llamacpp`: two llama-servers, one core each (`make peers-llamacpp`)."""
    if str(PEERS_DIR) not in sys.path:
        sys.path.insert(0, str(PEERS_DIR))
    if name == "vllm":
        from vllm_peer import VllmDedicatedPeer

        return PeerClient(VllmDedicatedPeer(embed_model=embed_model, **kwargs), return_embeddings)
    if name == "llamacpp":
        from llamacpp_peer import LlamaCppPairPeer

        return PeerClient(LlamaCppPairPeer(embed_model=embed_model, temperature=temperature, **kwargs),
                          return_embeddings)
    if name == "hf":
        from hf_peer import HfPeer

        return PeerClient(HfPeer(embed_model=embed_model, temperature=temperature, **kwargs), return_embeddings)
    raise ValueError(f"unknown peer {name!r}; expected one of {', '.join(PEERS)}")


def peer_client(name: str, return_embeddings: bool = False, tokenizer: Any = None, embedding_space: Any = None,
                **kwargs: Any) -> Any:  # -> DeploymentClient
    """`make_peer` as the `EngineClient` every system of a benchmark is."""
    from orthrus_rag.engine.clients import DeploymentClient

    return DeploymentClient(make_peer(name, return_embeddings=return_embeddings, **kwargs), name=name,
                            tokenizer=tokenizer, embedding_space=embedding_space)
