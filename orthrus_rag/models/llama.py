"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over one flat token batch with a paged KV cache.

Module and parameter names mirror transformers' so a checkpoint's state dict loads by name and PEFT adapters
find their target modules.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from orthrus_rag.layers import cpu_elementwise
from orthrus_rag.layers.context import get_forward_context
from orthrus_rag.layers.cpu_elementwise import add_rms_norm
from orthrus_rag.layers.cpu_extension import kernels
from orthrus_rag.layers.cpu_layer_loop import LayerLoop
from orthrus_rag.layers.fused import fuse, project

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# NOTE: Qwen3 is Llama plus an RMSNorm over each head's queries and keys (before rotary)
QK_NORM_MODEL_TYPES = ("qwen3",)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: transformers' LlamaRMSNorm normalises in float32, casts back, then scales; F.rms_norm is one fused
        # op with the same result (bit-identical in fp32, measured)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, layer_type: str | None = None) -> None:
        """`layer_type` picks one entry of a per-layer-type `rope_parameters` (Gemma 3: sliding / full)."""
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if layer_type is not None:
            rope = dict(rope[layer_type] or {})
        rope_type = rope.get("rope_type", "default")
        # NOTE: computed on CPU even under an ambient `torch.device("meta")` (the loader builds the model there):
        # transformers' scaled-rope functions call `.to("cpu")` on tensors that would otherwise be meta
        if rope_type in ("dynamic", "longrope"):
            # NOTE: these switch frequencies with the sequence length at run time; not implemented
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, yarn")
        with torch.device("cpu"):
            if rope_type == "default":
                base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
                inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
                self.attention_scaling = 1.0
            else:
                # NOTE: scaled variants (llama3, yarn, ...) come from transformers' own table
                kwargs = {} if layer_type is None else {"layer_type": layer_type}
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a *signed* sin [T, D] for `apply_rotary`: the sin's first half negated, so that rotating half
        the features is one `roll` (no slicing, negating and concatenating per layer)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]: transformers' `x * cos + rotate_half(x) * sin`, bit for bit (roll(x) = [x2, x1], and
    [x2, x1] * [-s, s] = [-x2 * s, x1 * s] = rotate_half(x) * sin)."""
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[:, None, :]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


ELEMENTWISE = ("torch", "cpp", "compiled")


@lru_cache(maxsize=1)
def _compiled() -> tuple[Callable, Callable]:
    # NOTE: compiled once per process, not per model: each compile costs seconds
    return (torch.compile(apply_rotary, dynamic=True, fullgraph=True),
            torch.compile(silu_mul, dynamic=True, fullgraph=True))


def elementwise_ops(kind: str) -> tuple[Callable, Callable]:
    """(rotary, SiLU-and-mul) of an elementwise implementation: "torch" (eager ops), "cpp" (the fused C++ kernels
    of layers/cpu_elementwise.py: fp32 or bf16 on the CPU) or "compiled" (torch.compile: Triton on CUDA, two
    launches where eager mode takes ten per layer)."""
    if kind == "cpp":
        return cpu_elementwise.rotary, cpu_elementwise.silu_mul
    if kind == "compiled":
        return _compiled()
    if kind != "torch":
        raise ValueError(f"unknown elementwise implementation {kind!r}; expected {', '.join(ELEMENTWISE)}")
    return apply_rotary, silu_mul


def _layer_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window


class Attention(nn.Module):
    QKV = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which of the runner's KV caches is this layer's
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.window = _layer_window(config, layer_idx)
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        o_bias = getattr(config, "attention_bias", False) and config.model_type != "qwen2"
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=o_bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.model_type in QK_NORM_MODEL_TYPES:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = apply_rotary  # CausalLM.set_elementwise: the plan's implementation

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = project(self, "qkv", self.QKV, x)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head, over head_dim (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        ctx = get_forward_context()
        assert ctx.attn is not None, "forward outside a runner step"
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        o = ctx.attn_backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim), k_cache, v_cache, ctx.attn,
                                     self.scale, self.window)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    GATE_UP = ("gate_proj", "up_proj")

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        act = getattr(config, "hidden_act", None) or config.hidden_activation  # NOTE: Gemma names it differently
        self.act = ACT2FN[act]
        self.silu = act == "silu"  # NOTE: only SiLU has fused implementations (CausalLM.set_elementwise)
        self.act_mul = silu_mul if self.silu else (lambda gate, up: self.act(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, "gate_up", self.GATE_UP, x)
        return self.down_proj(self.act_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      next_norm: RMSNorm) -> torch.Tensor:
        """`forward` with each residual add fused into the norm after it (cpu_elementwise.add_rms_norm): `h` is
        this layer's normed input, `residual` the running sum (updated in place); returns `next_norm` of the sum,
        the next layer's normed input (or the model's output)."""
        # NOTE: .forward, not __call__: the CPU fast path has no hooks, and __call__ costs ~1-2 us a module
        h = add_rms_norm(self.self_attn.forward(h, cos, sin), residual, self.post_attention_layernorm.weight,
                         self.post_attention_layernorm.eps)
        return add_rms_norm(self.mlp.forward(h), residual, next_norm.weight, next_norm.eps)


def _loop_covers(layer: nn.Module) -> bool:
    """Whether the C++ layer loop computes all of `layer` (its model on the fused kernels): a plain Llama layer."""
    att, mlp = layer.self_attn, layer.mlp
    return (type(layer) is DecoderLayer and att.q_norm is None and mlp.silu
            and set(getattr(att, "fusions", {})) == {"qkv"} and set(getattr(mlp, "fusions", {})) == {"gate_up"}
            and isinstance(att.o_proj, nn.Linear) and isinstance(mlp.down_proj, nn.Linear))


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.config = config
        self._fused_norms = False
        self.elementwise = "torch"  # rotary and SiLU-mul's implementation (CausalLM.set_elementwise)
        self._layer_loop: LayerLoop | None = None
        self._run_layers = self._plain_layers  # the layers' path: chosen when the two settings below are set
        self.init_rotary()

    @property
    def fused_norms(self) -> bool:
        """CausalLM.use_cpu_kernels: residual adds fused into the norms."""
        return self._fused_norms

    @fused_norms.setter
    def fused_norms(self, value: bool) -> None:
        self._fused_norms = value
        self._choose_path()

    @property
    def layer_loop(self) -> LayerLoop | None:
        """CausalLM.use_cpu_layer_loop: the fused loop in one C++ call (with fused_norms)."""
        return self._layer_loop

    @layer_loop.setter
    def layer_loop(self, loop: LayerLoop | None) -> None:
        self._layer_loop = loop
        self._choose_path()

    def _choose_path(self) -> None:
        """Pick the layers' path once, when a setting changes, so `forward` does not decide it at every step."""
        if not self._fused_norms:
            self._run_layers = self._plain_layers
        elif self._layer_loop is None:
            self._run_layers = self._fused_layers
        else:
            self._run_layers = self._looped_layers

    def init_rotary(self, device: str | torch.device = "cpu") -> None:
        """(Re)build the rotary table: a non-persistent buffer, left uninitialised by `to_empty`."""
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(self.config, head_dim).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        return self._run_layers(x, cos, sin)

    def _plain_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def _fused_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.layers[0].input_layernorm(x)  # NOTE: x, a fresh tensor, becomes the running residual sum
        return self._fused_loop(h, x, cos, sin)

    def _looped_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The C++ layer loop; a step it does not cover (None) takes the Python loop of the same kernels."""
        h = self.layers[0].input_layernorm(x)  # NOTE: as in _fused_layers
        out = self._layer_loop(h, x, cos, sin)
        return out if out is not None else self._fused_loop(h, x, cos, sin)

    def _fused_loop(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
        for layer, next_norm in zip(self.layers, [*(lr.input_layernorm for lr in self.layers[1:]), self.norm]):
            h = layer.forward_fused(h, residual, cos, sin, next_norm)
        return h


class CausalLM(nn.Module):
    """The shared backbone: `forward` gives final (normed) hidden states for every row; generation rows go
    through `compute_logits`, embedding rows to the poolers."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported decoder architecture {config.model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def set_elementwise(self, kind: str) -> None:
        """Rotary and SiLU-and-mul as `kind` (`elementwise_ops`: "torch", "cpp", "compiled"), as the execution plan
        decides (engine/executor/plan.py); "cpp" also fuses each residual add into the norm after it. Any other
        kind drops the C++ layer loop, which calls the fused kernels."""
        rotary, act_mul = elementwise_ops(kind)
        model = self.model
        for layer in model.layers:
            layer.self_attn.rotary = rotary
            if layer.mlp.silu:
                layer.mlp.act_mul = act_mul
        model.elementwise = kind
        # NOTE: only plain RMSNorms fuse: Gemma 3's are (1 + w) x / rms, and a full-delta adapter wraps a norm in
        # a RowDeltaModule whose per-slot deltas the fused call would skip
        model.fused_norms = kind == "cpp" and isinstance(model, DecoderModel) and all(
            type(norm) is RMSNorm for norm in [model.norm, *(n for layer in model.layers
                                                             for n in (layer.input_layernorm,
                                                                       layer.post_attention_layernorm))])
        if kind != "cpp" and isinstance(model, DecoderModel):
            model.layer_loop = None

    def compile_elementwise(self) -> None:
        self.set_elementwise("compiled")

    def use_cpu_kernels(self) -> None:
        """The fused C++ kernels (fp32 or bf16 on the CPU; callers check `cpu_elementwise.available`)."""
        self.set_elementwise("cpp")

    def use_cpu_layer_loop(self) -> bool:
        """After `use_cpu_kernels`: every step that the layer loop supports runs all layers in one C++ call
        (layers/cpu_layer_loop.py). Returns whether this model's layers allow it."""
        model = self.model
        if (type(model) is not DecoderModel or not model.fused_norms or kernels() is None
                or not all(_loop_covers(layer) for layer in model.layers)):
            return False
        model.layer_loop = LayerLoop(model)
        return True

    def kernel_inputs_changed(self) -> None:
        """After packing or adapters changed (layers/linear.py, layers/lora.py): the C++ layer loop gathers its
        arguments anew."""
        loop = getattr(self.model, "layer_loop", None)
        if loop is not None:
            loop.refresh()

    def fuse_projections(self) -> None:
        """Q/K/V and gate/up as one GEMM each (layers/fused.py). Call once the weights are on their device."""
        for layer in self.model.layers:
            self.fuse_layer(layer)

    @staticmethod
    def fuse_layer(layer: nn.Module) -> None:
        """One decoder layer's Q/K/V and gate/up fused (the loader calls it as each layer's weights arrive)."""
        fuse(layer.self_attn, "qkv", Attention.QKV)
        fuse(layer.mlp, "gate_up", MLP.GATE_UP)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
