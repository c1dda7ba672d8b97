"""Build an Engine from an EngineConfig: resolve and load the decoder, adapters, encoder and tokenizers."""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer

from orthrus_rag.config import EngineConfig
from orthrus_rag.engine.engine import Engine
from orthrus_rag.layers.linear import choose_kernel, onednn_available, pack_linears
from orthrus_rag.layers.lora import attach_adapters, load_peft_adapter
from orthrus_rag.models.bert import BertEncoder, read_max_seq_length, read_sentence_transformers_pooling
from orthrus_rag.models.loader import load_decoder
from orthrus_rag.models.registry import resolve_model_path

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> Engine:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    mc = config.model
    path = resolve_model_path(mc.model)
    logger.info("loading decoder from %s", path)
    model = load_decoder(path, mc.torch_dtype, mc.device)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    slots: dict[str, int] = {}
    if mc.embedding_adapters:
        slots = attach_adapters(model, [load_peft_adapter(p) for p in mc.embedding_adapters])
    encoder = encoder_tokenizer = None
    encoder_pooling: dict = {}
    if mc.embedding_model is not None:
        enc_path = resolve_model_path(mc.embedding_model)
        logger.info("loading embedding model from %s", enc_path)
        encoder = BertEncoder.from_pretrained(enc_path, mc.torch_dtype, mc.device).eval()
        encoder_tokenizer = AutoTokenizer.from_pretrained(str(enc_path))
        encoder_pooling = read_sentence_transformers_pooling(enc_path)
        # NOTE: sentence-transformers cuts inputs at max_seq_length (256 for MiniLM), below the 512 positions
        encoder.max_seq_length = read_max_seq_length(enc_path) or encoder.max_position_embeddings
    if mc.compile_elementwise and torch.device(mc.device).type == "cuda":
        model.compile_elementwise()
    if _use_onednn(mc.linear_kernel, model, mc.torch_dtype, mc.device):
        pack_linears(model)  # after the adapters: LoRALinear keeps the packed copy of the layer it wraps
        if encoder is not None:
            pack_linears(encoder)
    return Engine(config, model, tokenizer, slots, encoder, encoder_tokenizer, encoder_pooling)


def _use_onednn(kernel: str, model: torch.nn.Module, dtype: torch.dtype, device: str) -> bool:
    if kernel == "dense" or not onednn_available(dtype, device):
        return False
    if kernel == "onednn":
        return True
    shapes = []
    for parent in model.modules():
        shapes += [(f.carrier.in_features, f.carrier.out_features) for f in getattr(parent, "fusions", {}).values()]
        shapes += [(m.in_features, m.out_features) for m in parent.children()
                   if isinstance(m, torch.nn.Linear) and not getattr(m, "_fused", False)]
    return choose_kernel(shapes) == "onednn"
