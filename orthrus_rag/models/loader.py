"""Build a decoder from a checkpoint folder and load its safetensors weights by name."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from orthrus_rag.models.gemma3 import GEMMA3_MODEL_TYPES, Gemma3CausalLM
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
    """An empty decoder (no random init: weights are loaded next)."""
    with torch.device("meta"):
        model = decoder_class(config)(config)
    model = model.to_empty(device=device).to(dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    # NOTE: to_empty leaves non-persistent buffers uninitialised; rebuild the rotary table(s)
    model.model.init_rotary(device)
    return model


def load_weights(model: CausalLM, path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key if key in params else f"model.{key}"
                if name not in params:
                    if "rotary_emb" not in key:
                        logger.warning("ignoring unexpected weight %s in %s", key, file.name)
                    continue
                tensor = f.get_tensor(key)
                if tensor.shape != params[name].shape:
                    raise ValueError(f"weight {key}: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"{tuple(params[name].shape)}")
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {missing[:3]}")


def load_decoder(path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    model = build_decoder(load_config(path), dtype, device)
    load_weights(model, path)
    model.fuse_projections()
    return model.eval()
