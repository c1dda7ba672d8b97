"""BERT-style bidirectional encoder over a flat (packed, unpadded) token batch.

Parameter names mirror transformers' ``BertModel`` (without the pooler), so loading a
checkpoint is a straight copy of tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, BertConfig
from transformers.activations import ACT2FN

from orthrus_rag.layers.attention.cpu_encoder import encoder_attention, encoder_kernel_available
from orthrus_rag.layers.linear import linear_gelu
from orthrus_rag.params import POOLING_TYPES

# Checkpoint entries we do not model: the NSP pooler, MLM/NSP heads, the position_ids buffer.
_IGNORED_PREFIXES = ("pooler.", "cls.")
_IGNORED_SUFFIXES = ("position_ids",)
_ROOTS = ("embeddings.", "encoder.", "pooler.", "cls.")


class BertEmbeddings(nn.Module):
    """word + position + token_type embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:  # NOTE: one segment (an embedding input): one row of the table, broadcast
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (p(x).view(t, self.num_heads, self.head_dim) for p in (self.query, self.key, self.value))
        return packing.attend(q, k, v).reshape(t, -1)


class BertSelfOutput(nn.Module):
    """Projection + residual + LayerNorm (used after attention and after the MLP)."""

    def __init__(self, in_size: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config.hidden_size, config)

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        return self.output(self.self(x, packing), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        # NOTE: ACT2FN["gelu"] is the exact erf GELU that BERT was trained with.
        self.act = ACT2FN[config.hidden_act]
        # the exact GELU, fused into the projection's oneDNN kernel where the projection has its packed copy
        self.exact_gelu = config.hidden_act == "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact_gelu:
            return linear_gelu(self.dense, x)
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        x = self.attention(x, packing)
        return self.output(self.intermediate(x), x)


class BertEncoderStack(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertEncoder(nn.Module):
    """Bidirectional BERT encoder; attention stays within each packed sequence."""

    # checkpoint entries this class does not model (a subclass with a head keeps the pooler: `cross_encoder.py`)
    ignored_prefixes: tuple[str, ...] = _IGNORED_PREFIXES

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"hidden_size {config.hidden_size} is not divisible by "
                             f"num_attention_heads {config.num_attention_heads}")
        self.config = config
        # attention on the CPU kernel where it runs (attention/cpu_encoder.py); False: SDPA always
        self.cpu_attention_kernel = True
        # a step's sequences run through all the layers in passes of at most this many tokens: a 16k-token step's
        # activations ([16k, 1536] in the FFN: 50 MB in bf16) are fresh pages at every op (glibc maps allocations
        # over 32 MB anew), and smaller passes keep them in cache; 5-10% of MiniLM's forward on 2 EPYC cores
        self.max_pass_tokens = 4096
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoderStack(config)

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> BertEncoder:
        """Build from a folder holding config.json and model.safetensors."""
        config = AutoConfig.from_pretrained(str(path))
        if not isinstance(config, BertConfig):
            raise TypeError(f"{path}: expected a BERT config, got {type(config).__name__}")
        cls.check_config(config, path)
        with torch.device("meta"):
            model = cls(config)
        weights = load_file(str(Path(path) / "model.safetensors"), device=str(device))
        state = {}
        for key, tensor in weights.items():
            key = _strip_prefix(key)
            if not key.startswith(cls.ignored_prefixes) and not key.endswith(_IGNORED_SUFFIXES):
                state[key] = tensor.to(dtype)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
        if missing or unexpected:
            raise ValueError(f"{path}/model.safetensors does not match {cls.__name__}: "
                             f"missing keys {missing}, unexpected keys {unexpected}")
        model.load_state_dict(state, assign=True)
        return model.eval()

    @classmethod
    def check_config(cls, config: BertConfig, path: str | os.PathLike) -> None:
        """Refuse a checkpoint this class cannot run, before its weights load (a subclass's rule)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Packed [T] ids/positions (sequences back to back) -> last hidden states [T, hidden]. `token_type_ids`:
        each token's segment (a cross-encoder's query 0, passage 1); None: all segment 0."""
        num_tokens = input_ids.shape[0]
        if sum(seq_lens) != num_tokens or positions.shape[0] != num_tokens:
            raise ValueError(f"seq_lens sum to {sum(seq_lens)} but input_ids has {num_tokens} "
                             f"and positions {positions.shape[0]} tokens")
        if num_tokens and int(positions.max()) >= self.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} exceeds the model's "
                             f"max_position_embeddings {self.max_position_embeddings}")
        if token_type_ids is not None and token_type_ids.shape[0] != num_tokens:
            raise ValueError(f"token_type_ids has {token_type_ids.shape[0]} tokens but input_ids has {num_tokens}")
        if num_tokens > self.max_pass_tokens:
            return torch.cat([self._forward(input_ids[a:b], positions[a:b], seq_lens[i:j],
                                            None if token_type_ids is None else token_type_ids[a:b])
                              for i, j, a, b in passes(seq_lens, self.max_pass_tokens)])
        return self._forward(input_ids, positions, seq_lens, token_type_ids)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        packing = Packing(seq_lens, self.cpu_attention_kernel)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, packing)
        return x


def passes(seq_lens: list[int], max_tokens: int) -> list[tuple[int, int, int, int]]:
    """Whole sequences in order, grouped into passes of at most `max_tokens` tokens (a longer sequence alone):
    (first sequence, end sequence, first token, end token) of each."""
    out: list[tuple[int, int, int, int]] = []
    i = a = 0
    while i < len(seq_lens):
        j, b = i + 1, a + seq_lens[i]
        while j < len(seq_lens) and b + seq_lens[j] <= a + max_tokens:
            b += seq_lens[j]
            j += 1
        out.append((i, j, a, b))
        i, a = j, b
    return out


class Packing:
    """The packed sequences' boundaries, for attention that stays inside each sequence, with no mask and no padding
    (a [T, T] block-diagonal mask over a 4k-token step was ~40x the work; padding to the longest wastes what the
    lengths differ by). Where the CPU kernel pays (attention/cpu_encoder.py: fp32, or bf16 on AVX512-BF16
    or AMX) one call per layer covers every sequence; elsewhere one SDPA call per sequence on views of the
    packed tensors, so attention costs the sum of L^2."""

    def __init__(self, seq_lens: list[int], kernel: bool = True) -> None:
        self.seq_lens = list(seq_lens)
        self.kernel = kernel
        self._bounds: tuple[torch.Tensor, torch.Tensor] | None = None

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's first row and length (int64, CPU), made once and shared by every layer."""
        if self._bounds is None:
            lens = torch.tensor(self.seq_lens, dtype=torch.int64)
            self._bounds = (torch.cumsum(lens, 0) - lens, lens)
        return self._bounds

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[T, H, D] each -> [T, H, D]."""
        if self.kernel and encoder_kernel_available(q):
            return encoder_attention(q, k, v, *self.bounds(), q.shape[-1] ** -0.5)
        # NOTE: 4-D [1, H, L, D]: torch's CPU flash kernel takes only those (3-D falls back to the math path)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if len(self.seq_lens) == 1:
            return F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
        outs = [F.scaled_dot_product_attention(qs, ks, vs) for qs, ks, vs in
                zip(q.split(self.seq_lens, 2), k.split(self.seq_lens, 2), v.split(self.seq_lens, 2))]
        return torch.cat(outs, 2)[0].transpose(0, 1)


def _strip_prefix(key: str) -> str:
    """Drop wrappers such as "bert." or "0.auto_model." before the BertModel root names."""
    for root in _ROOTS:
        if key.startswith(root):
            return key
        idx = key.find("." + root)
        if idx >= 0:
            return key[idx + 1:]
    return key


def read_sentence_transformers_pooling(path: str | os.PathLike) -> dict:
    """Pooling method and L2 normalisation from a sentence-transformers folder.

    Returns {"pooling": "mean" | "cls" | "max" | "mean_sqrt_len" | "lasttoken" | ..., "normalize": bool}.
    """
    modules = json.loads((Path(path) / "modules.json").read_text())
    pooling_module = next((m for m in modules if m["type"].endswith(".Pooling")), None)
    if pooling_module is None:
        raise ValueError(f"{path}/modules.json has no sentence_transformers Pooling module")
    cfg = json.loads((Path(path) / pooling_module["path"] / "config.json").read_text())
    # Newer sentence-transformers may store the mode as one string.
    pooling = cfg.get("pooling_mode")
    if pooling is None:
        modes = [k[len("pooling_mode_"):] for k, v in cfg.items()
                 if k.startswith("pooling_mode_") and v is True]
        if len(modes) != 1:
            raise ValueError(f"{path}: expected exactly one pooling mode, got {modes}")
        pooling = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max",
                   "mean_sqrt_len_tokens": "mean_sqrt_len"}.get(modes[0], modes[0])
    normalize = any(m["type"].endswith(".Normalize") for m in modules)
    if pooling == "lasttoken":
        pooling = "last"
    if pooling not in POOLING_TYPES:
        raise ValueError(f"{path}: sentence-transformers pooling {pooling!r} is not supported; "
                         f"supported: {', '.join(POOLING_TYPES)}")
    return {"pooling": pooling, "normalize": normalize}


def read_max_seq_length(path: str | os.PathLike) -> int | None:
    """sentence-transformers' `max_seq_length` (inputs are cut there), or None when the folder has none."""
    file = Path(path) / "sentence_bert_config.json"
    if not file.is_file():
        return None
    value = json.loads(file.read_text()).get("max_seq_length")
    return int(value) if value else None
