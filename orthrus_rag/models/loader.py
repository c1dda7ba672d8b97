"""Build a decoder from a checkpoint folder and load its weights by name, layer by layer: from the folder's safetensors
or a GGUF file (models/gguf_weights.py), each layer fused and, when asked, stored quantized as it loads."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from orthrus_rag.layers.quantized import ROW_CHUNK, quantize_linears, quantize_rows
from orthrus_rag.memory import release_free_memory
from orthrus_rag.models.gemma3 import GEMMA3_MODEL_TYPES, Gemma3CausalLM
from orthrus_rag.models.gguf_weights import GGUFWeights
from orthrus_rag.models.llama import CausalLM

logger = logging.getLogger(__name__)


def load_config(path: Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(path))


def decoder_class(config: PretrainedConfig) -> type[CausalLM]:
    """The decoder implementation for a config's model_type (CausalLM refuses types it does not know)."""
    if config.model_type == "gemma3":
        # NOTE: the multimodal checkpoints (gemma-3-4b and up) nest the text model under a vision tower
        raise ValueError("multimodal Gemma 3 (model_type 'gemma3') is not supported; text-only Gemma 3 "
                         "(model_type 'gemma3_text', e.g. gemma-3-1b / Gemma3ForCausalLM) is")
    return Gemma3CausalLM if config.model_type in GEMMA3_MODEL_TYPES else CausalLM


def build_decoder(config: PretrainedConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """An empty decoder (no random init: weights are loaded next). Its memory is allocated in `dtype` and left
    untouched, so a page becomes resident only when a weight is written into it: a layer stored quantized as it
    loads never holds its dense weights at all but for its own turn."""
    with torch.device("meta"):
        model = decoder_class(config)(config)
    model = model.to(dtype).to_empty(device=device)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    # NOTE: to_empty leaves non-persistent buffers uninitialised; rebuild the rotary table(s)
    model.model.init_rotary(device)
    return model


class SafetensorsWeights:
    """A checkpoint folder's `*.safetensors` tensors by the decoder's parameter names (a key may lack the
    `model.` prefix), read one at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {path}")
        self._where: dict[str, tuple[Path, str]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    self._where[key] = (file, key)

    def _key(self, name: str) -> str | None:
        if name in self._where:
            return name
        short = name.removeprefix("model.")
        return short if short in self._where else None

    def has(self, name: str) -> bool:
        return self._key(name) is not None

    def unread(self, names: set[str]) -> list[str]:
        read = {self._key(n) for n in names}
        return sorted(k for k in self._where if k not in read and "rotary_emb" not in k)

    def get(self, name: str) -> torch.Tensor:
        file, key = self._where[self._key(name)]  # type: ignore[index]
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(key)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        file, key = self._where[self._key(name)]  # type: ignore[index]
        with safe_open(str(file), framework="pt") as f:
            return f.get_slice(key)[start:stop]


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
LayerHook = Callable[[int, dict[str, torch.Tensor]], None]


def load_weights(model: CausalLM, source: SafetensorsWeights | GGUFWeights, after_layer: LayerHook | None = None,
                 ) -> None:
    """Copy every parameter from `source`: the ones outside the layers first (a large table in pieces of rows),
    then layer by layer, calling `after_layer(i, {name: tensor as read})` once layer i is in (the loader fuses and
    quantizes it there, from the tensors as the source holds them)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    wanted = [n for n in params if not (tied and n == "lm_head.weight")]
    missing = [n for n in wanted if not source.has(n)]
    if missing:
        raise ValueError(f"checkpoint {source.path} lacks {len(missing)} weights, e.g. {missing[:3]}")
    for key in source.unread(set(wanted)):
        logger.warning("ignoring unexpected weight %s in %s", key, source.path.name)
    by_layer: dict[int, list[str]] = {}
    for name in wanted:
        m = _LAYER.match(name)
        if m is None:
            _copy_rows(params[name], source, name)
        else:
            by_layer.setdefault(int(m.group(1)), []).append(name)
    for i in sorted(by_layer):
        # NOTE: popped, so that a dense weight the hook replaces is freed with the layer, not held here to the end
        read = {name: _copy(params.pop(name), source.get(name), name) for name in by_layer[i]}
        if after_layer is not None:
            after_layer(i, read)


def _copy_rows(param: torch.nn.Parameter, source: SafetensorsWeights | GGUFWeights, name: str) -> None:
    """`param` from `source`, a matrix `ROW_CHUNK` rows at a time (an embedding table is never whole in fp32)."""
    if param.dim() != 2:
        _copy(param, source.get(name), name)
        return
    rows = param.shape[0]
    for start in range(0, rows, ROW_CHUNK):
        stop = min(start + ROW_CHUNK, rows)
        tensor = source.rows(name, start, stop)
        if tensor.shape != param[start:stop].shape:
            raise ValueError(f"weight {name}: checkpoint rows {tuple(tensor.shape)} != model "
                             f"{tuple(param[start:stop].shape)}")
        with torch.no_grad():
            param[start:stop].copy_(tensor)


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.shape != param.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    return tensor


def load_decoder(path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 gguf: Path | None = None, quantization: tuple[str, str] = ("none", "none")) -> CausalLM:
    """The decoder of the checkpoint folder `path` (its config; its weights, or those of the GGUF file `gguf`),
    Q/K/V and gate/up fused. `quantization`: (the layers' form, the LM head's), each none | int8 | int4
    (layers/quantized.py): each layer is stored in its form as soon as it is read, from the tensors as the
    checkpoint holds them (so the shipped Q4_1 file's blocks come back bit for bit), before the next is read."""
    config = load_config(path)
    model = build_decoder(config, dtype, device)
    source = GGUFWeights(gguf, config.num_hidden_layers, config.num_attention_heads,
                         getattr(config, "num_key_value_heads", None) or config.num_attention_heads) \
        if gguf is not None else SafetensorsWeights(path)
    layers_kind, head_kind = quantization

    def finish(i: int, read: dict[str, torch.Tensor]) -> None:
        layer = model.model.layers[i]
        model.fuse_layer(layer)
        if layers_kind != "none":
            prefix = f"model.layers.{i}."
            quantize_linears(layer, layers_kind, weight_of=_read_weights(layer, prefix, read), quiet=True)
            # NOTE: the layer's dense and fp32 copies were just freed; glibc keeps such blocks for reuse, and a
            # model's worth of them would stay resident (memory.py)
            read.clear()
            release_free_memory()

    load_weights(model, source, finish)
    if layers_kind != "none":
        logger.info("decoder layers stored %s as they loaded", layers_kind)
    if head_kind != "none":
        lm_head = model.lm_head
        name = "lm_head.weight" if source.has("lm_head.weight") else "model.embed_tokens.weight"
        quant = quantize_rows(lambda a, b: source.rows(name, a, b), lm_head.out_features, head_kind, dtype)
        quantize_linears(model, head_kind, keep=lambda m: m is lm_head, weight_of=lambda m: quant)
    release_free_memory()
    model.kernel_inputs_changed()
    return model.eval()


def _read_weights(layer: torch.nn.Module, prefix: str, read: dict[str, torch.Tensor],
                  ) -> Callable[[torch.nn.Module], torch.Tensor | None]:
    """For quantize_linears: each Linear of `layer` -> its weight as read (a fusion's carrier: its parts' rows
    concatenated), so quantizing starts from the checkpoint's own values, not their copy in the model's dtype."""
    by_module: dict[int, torch.Tensor] = {}
    for name, module in layer.named_modules():
        weight = read.get(f"{prefix}{name}.weight")
        if weight is not None:
            by_module[id(module)] = weight
        for fusion in getattr(module, "fusions", {}).values():
            scope = f"{prefix}{name}." if name else prefix
            by_module[id(fusion.carrier)] = torch.cat([read[f"{scope}{part}.weight"] for part in fusion.names])
    return lambda module: by_module.get(id(module))
