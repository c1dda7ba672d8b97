"""Gemma 3 text decoder (`gemma3_text`, e.g. gemma-3-1b) over one flat token batch with a paged KV cache.

What differs from the Llama family (llama.py), each mirrored from transformers' Gemma3 modeling code:
- RMSNorm scales by `1 + weight` (weights are stored zero-centred) and multiplies before casting back;
- the token embedding is scaled by sqrt(hidden_size) (in the activation dtype, as transformers does);
- four norms per layer: input, post-attention, pre-feedforward, post-feedforward (sandwich norms);
- per-head q/k norms, attention scale `query_pre_attn_scalar ** -0.5`;
- layers alternate sliding-window ("sliding_attention") and global ("full_attention") attention, each kind with
  its own rotary base (local 10k, global 1M by default) and, for the global kind, its own rope scaling;
- optional tanh soft-capping of the final logits.
Module and parameter names mirror transformers' so checkpoints load by name and PEFT adapters find their targets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from orthrus_rag.models.llama import MLP, Attention, CausalLM, RotaryEmbedding

GEMMA3_MODEL_TYPES = ("gemma3_text",)
_LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma3RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: transformers normalises and scales in float32, then casts: (x * w).to(dtype), not x.to(dtype) * w
        out = F.rms_norm(x.float(), self.weight.shape, None, self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


def _check_config(config: PretrainedConfig) -> None:
    """Refuse what this decoder does not implement rather than compute something else."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("Gemma attention-logit soft-capping (attn_logit_softcapping, Gemma 2) is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional Gemma 3 (use_bidirectional_attention, EmbeddingGemma) cannot run on the "
                         "causal paged engine")
    unknown = set(config.layer_types) - set(_LAYER_TYPES)
    if unknown:
        raise ValueError(f"unknown Gemma 3 layer types {sorted(unknown)}; expected {_LAYER_TYPES}")


class Gemma3Attention(Attention):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = MLP(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.init_rotary()

    def init_rotary(self, device: str | torch.device = "cpu") -> None:
        """One rotary table per layer type present (local and global bases differ)."""
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary_embs = nn.ModuleDict({
            kind: RotaryEmbedding(self.config, head_dim, layer_type=kind).to(device)
            for kind in sorted(set(self.config.layer_types))})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # NOTE: the scale is cast to the activation dtype first, as transformers does (bf16: sqrt(3072) -> 55.5)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        tables = {kind: rope(positions, x.dtype) for kind, rope in self.rotary_embs.items()}
        for layer in self.layers:
            x = layer(x, *tables[layer.layer_type])
        return self.norm(x)


class Gemma3CausalLM(CausalLM):
    """Gemma 3 as the shared backbone: same interface as the Llama family's CausalLM."""

    def __init__(self, config: PretrainedConfig) -> None:
        if config.model_type not in GEMMA3_MODEL_TYPES:
            raise ValueError(f"Gemma3CausalLM needs model_type gemma3_text, got {config.model_type!r}")
        _check_config(config)
        nn.Module.__init__(self)  # NOTE: CausalLM.__init__ would build a Llama body and refuse the model type
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
