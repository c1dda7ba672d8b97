"""Load what an Engine runs from an EngineConfig: the decoder, adapters, encoder and tokenizers.

NOTE: this module does not import the engine (`Engine.from_config` calls it), so the two never form a cycle."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoTokenizer

from orthrus_rag.config import EngineConfig
from orthrus_rag.embedding_formats import adapter_prefixes
from orthrus_rag.engine.executor.plan import (choose_decode_linears, choose_encoder, choose_layers, choose_linears,
                                              choose_lora)
from orthrus_rag.layers.linear import (GEMV_BUCKETS, GEMV_MAX_ROWS, ROW_BUCKETS, choose_gemv_rows, choose_kernel,
                                       linear_shapes, model_linears, onednn_available, pack_linears, packed_from,
                                       use_gemv)
from orthrus_rag.layers.lora import attach_adapters, load_peft_adapter, set_lora_kernel, use_cpu_lora_kernel
from orthrus_rag.layers.quantized import check_quantization
from orthrus_rag.machine import ONEDNN_BF16_FLAGS, machine_key, remembered
from orthrus_rag.engine.rerankers import is_backbone
from orthrus_rag.models.bert import BertEncoder, read_max_seq_length, read_sentence_transformers_pooling
from orthrus_rag.models.cross_encoder import BertCrossEncoder
from orthrus_rag.models.loader import load_decoder
from orthrus_rag.models.registry import (cache_root, decoder_files, gguf_quantization, gguf_source,
                                         resolve_adapter_path, resolve_model_path)

logger = logging.getLogger(__name__)


@dataclass
class LoadedModels:
    """`Engine.__init__`'s arguments after the config."""

    model: torch.nn.Module
    tokenizer: Any
    adapter_slots: dict[str, int] = field(default_factory=dict)
    adapter_kinds: dict[str, str] = field(default_factory=dict)  # name -> "generate" | "embed" | "both"
    adapter_prefixes: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> input type -> prefix
    encoder: torch.nn.Module | None = None
    encoder_tokenizer: Any = None
    encoder_pooling: dict = field(default_factory=dict)
    cross_encoders: dict[str, tuple[torch.nn.Module, Any]] = field(default_factory=dict)  # name -> (model, tokenizer)


def load_models(config: EngineConfig) -> LoadedModels:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    mc = config.model
    path, gguf = decoder_files(mc.name)
    dtype = str(mc.torch_dtype).removeprefix("torch.")
    logger.info("loading decoder %s (%s on %s, %d threads) from %s", mc.name, dtype, mc.device,
                torch.get_num_threads(), gguf or path)
    model = load_decoder(path, mc.torch_dtype, mc.device, gguf, _quantization(mc.quantization, mc.name, mc.device))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    slots: dict[str, int] = {}
    adapters = mc.loaded_adapters()
    kinds = {name: kind for name, (_, kind) in adapters.items()}
    folders = {name: resolve_adapter_path(folder) for name, (folder, _) in adapters.items()}
    loaded = [load_peft_adapter(folder, name) for name, folder in folders.items()]
    prefixes = adapter_prefixes(folders)
    if len(loaded) < len(mc.embedding_adapters) + len(mc.adapters):
        raise ValueError("two adapters share a name (an embedding adapter is named by its folder): "
                         f"{', '.join(list(mc.adapters) + [str(p) for p in mc.embedding_adapters])}")
    if loaded:
        slots = attach_adapters(model, loaded)
    encoder = encoder_tokenizer = None
    encoder_pooling: dict = {}
    if mc.embedding_model is not None:
        enc_path = resolve_model_path(mc.embedding_model)
        logger.info("loading embedding model %s (%s on %s) from %s", mc.embedding_model, dtype, mc.device, enc_path)
        encoder = BertEncoder.from_pretrained(enc_path, mc.torch_dtype, mc.device).eval()
        encoder_tokenizer = AutoTokenizer.from_pretrained(str(enc_path))
        encoder_pooling = read_sentence_transformers_pooling(enc_path)
        # NOTE: sentence-transformers cuts inputs at max_seq_length (256 for MiniLM), below the 512 positions
        encoder.max_seq_length = read_max_seq_length(enc_path) or encoder.max_position_embeddings
    apply_kernels(mc.requested_kernels(), model, encoder, mc.torch_dtype, torch.device(mc.device))
    return LoadedModels(model, tokenizer, slots, kinds, prefixes, encoder, encoder_tokenizer, encoder_pooling,
                        load_cross_encoders(config))


def load_cross_encoders(config: EngineConfig) -> dict[str, tuple[torch.nn.Module, Any]]:
    """The cross-encoder rerankers `model.rerankers` names (not the backbone's readings), on the kernels the plan
    chooses for an encoder."""
    mc, out = config.model, {}
    for name in mc.rerankers:
        if is_backbone(name):
            continue
        path = resolve_model_path(name)
        logger.info("loading reranker %s from %s", name, path)
        model = BertCrossEncoder.from_pretrained(path, mc.torch_dtype, mc.device).eval()
        _encoder_kernels(mc.requested_kernels(), model, mc.torch_dtype, torch.device(mc.device))
        out[name] = (model, AutoTokenizer.from_pretrained(str(path)))
    return out


def _encoder_kernels(want: dict[str, str], encoder: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """An encoder's attention and packed linears, as `apply_kernels` chooses them for the embedding model."""
    head_dim = encoder.config.hidden_size // encoder.config.num_attention_heads
    encoder.cpu_attention_kernel = choose_encoder(want["encoder_attention"], device, dtype, head_dim) == "cpp"
    from_rows = _packed_from(choose_linears(want["linears"], device, dtype), linear_shapes(encoder), dtype, str(device))
    if from_rows is not None:
        pack_linears(encoder, from_rows=from_rows)


def _quantization(quantization: str, name: str, device: str) -> tuple[str, str]:
    """(the decoder layers' form, the LM head's) for `model.quantization` (layers/quantized.py), stored as the
    weights load (models/loader.py), before adapters attach (LoRA stays in the model's dtype on the quantized base,
    as QLoRA does). `auto`: the GGUF file's own forms, layers and LM head apart (a Q4_1 file's layers map exactly:
    each block's extremes are codes 0 and 15), else none."""
    layers = head = quantization
    if quantization == "auto":
        source = gguf_source(name)
        layers, head = gguf_quantization(source) if source is not None else ("none", "none")
        logger.info("quantization auto: layers %s, LM head %s%s", layers, head,
                    f" (from {source.name})" if source is not None else "")
    for kind in (layers, head):
        if kind != "none":
            check_quantization(kind, device)
    return layers, head


def apply_kernels(want: dict[str, str], model: torch.nn.Module, encoder: torch.nn.Module | None, dtype: torch.dtype,
                  device: torch.device) -> None:
    """Put the loaded model and encoder on the implementations the plan chooses for `want` (each part's requested
    choice, config/kernels.py): the layers' elementwise kernels and driver, LoRA, packed linears, the encoder's
    attention. The runner applies the parts it owns (attention, sampler, CUDA graphs)."""
    layers = choose_layers(want["layers"], device, dtype)
    model.set_elementwise({"split": "cpp", "loop": "cpp", "fused": "cpp"}.get(layers, layers))
    lora = choose_lora(want["lora"], device, dtype)
    set_lora_kernel(model, lora if lora in ("per_slot", "stacked") else "auto")
    use_cpu_lora_kernel(model, lora == "cpp")
    if encoder is not None:
        head_dim = encoder.config.hidden_size // encoder.config.num_attention_heads
        encoder.cpu_attention_kernel = choose_encoder(want["encoder_attention"], device, dtype, head_dim) == "cpp"
    _pack(choose_linears(want["linears"], device, dtype), model, encoder, dtype, str(device))
    if choose_decode_linears(want["decode_linears"], device, dtype) == "cpp":
        _gemv(want["decode_linears"], model)
    # NOTE: last: the layer loop gathers the packed weights and the adapters as they are now
    if layers in ("split", "loop") and not model.use_cpu_layer_loop():
        if want["layers"] != "auto":
            raise ValueError(f"model.kernel_overrides: layers={layers} cannot run {type(model).__name__}'s layers "
                             "(the C++ loop takes plain Llama layers with fused norms: no per-head norms, no "
                             "full-delta adapters); use fused, torch or auto")
        logger.info("layers: %s's layers keep the Python loop of the fused kernels", type(model).__name__)
    if (loop := getattr(model.model, "layer_loop", None)) is not None and layers == "loop":
        loop.split = False
        loop.refresh()  # NOTE: without the split's second packed copy of the weights


def _decoder_groups(model: torch.nn.Module) -> list[tuple[str, Callable[[torch.nn.Module], bool]]]:
    """The decoder's linears in the two groups whose kernels are chosen apart: its layers and its LM head (the
    head's one wide shape can favour another kernel)."""
    head = getattr(model, "lm_head", None)
    return [("layers", lambda m: m is not head), ("LM head", lambda m: m is head)]


def _pack(kernel: str, model: torch.nn.Module, encoder: torch.nn.Module | None, dtype: torch.dtype,
          device: str) -> None:
    """oneDNN copies where they are faster, chosen for three groups apart, each from its own row count
    (`choose_kernel`): the decoder's layers, its LM head and the encoder. The head's one wide shape (SmolLM2:
    576 x 49,152, a fifth of a decode step's products) can favour the other kernel: with AVX2 code on an EPYC core
    oneDNN ran it 1.5-2x MKL's speed from 4 rows up, the layers' shapes 1.05-1.25x, and one row slower."""
    # NOTE: after the adapters: LoRALinear keeps the packed copy of the layer it wraps
    chosen: dict[str, int | None] = {}
    for group, keep in _decoder_groups(model):
        shapes = linear_shapes(model, keep)
        if shapes:
            chosen[group] = from_rows = _packed_from(kernel, shapes, dtype, device)
            if from_rows is not None:
                pack_linears(model, keep, from_rows)
    if encoder is not None:
        chosen["encoder"] = from_rows = _packed_from(kernel, linear_shapes(encoder), dtype, device)
        if from_rows is not None:
            pack_linears(encoder, from_rows=from_rows)
    if torch.device(device).type != "cpu":
        return
    # NOTE: the engine's plan line names the choice (engine/executor/plan.py); the timings behind it are at DEBUG
    why = (f" (oneDNN's packed bf16 path needs {ONEDNN_BF16_FLAGS})" if kernel == "auto" and dtype == torch.bfloat16
           and not onednn_available(dtype, device) else "")
    logger.debug("linear kernels (%s): %s%s", str(dtype).removeprefix("torch."), ", ".join(
        f"{group} {'dense' if rows is None else f'oneDNN from {rows} row' + 's' * (rows > 1)}"
        for group, rows in chosen.items()), why)


def _gemv(want: str, model: torch.nn.Module) -> None:
    """The few-row bf16 product for the decoder's layers and its LM head, each group up to its own row count
    (`choose_gemv_rows` under `auto`, timed against the kernel `_pack` left it; GEMV_MAX_ROWS asked for by name)."""
    chosen = {}
    for group, keep in _decoder_groups(model):
        shapes = linear_shapes(model, keep)
        if not shapes:
            continue
        first = next(m for _, _, m in model_linears(model) if keep(m) and getattr(m, "_quant", None) is None)
        from_rows = packed_from(first) if hasattr(first, "_onednn") else None
        chosen[group] = rows = GEMV_MAX_ROWS if want == "cpp" else _gemv_rows(shapes, from_rows)
        if rows:
            use_gemv(model, keep, rows)
    logger.debug("few-row bf16 product: %s", ", ".join(f"{g} up to {r} rows" for g, r in chosen.items()))


def _gemv_rows(shapes: list[tuple[int, int]], from_rows: int | None) -> int:
    """`choose_gemv_rows`, measured once per machine and remembered (as `_packed_from` is)."""
    parts = ("gemv", torch.get_num_threads(), sorted(set(shapes)), from_rows, GEMV_BUCKETS)
    return int(remembered(cache_root() / "linear_kernel.json", machine_key(*parts),
                          lambda: str(choose_gemv_rows(shapes, from_rows))))


def _packed_from(kernel: str, shapes: list[tuple[int, int]], dtype: torch.dtype, device: str) -> int | None:
    """The row count from which these shapes take their oneDNN copy; None: dense weights only."""
    if kernel == "dense" or not onednn_available(dtype, device):
        if kernel == "auto" and dtype == torch.bfloat16 and torch.device(device).type == "cpu":
            logger.debug("bf16 linears stay dense: oneDNN's packed bf16 path needs %s", ONEDNN_BF16_FLAGS)
        return None
    if kernel == "onednn":
        return 1
    # NOTE: measured once per machine and remembered: a timing near the threshold must not flip between runs
    # (a run resumed in a new process would compute other bits)
    # NOTE: the packed layout and the dtype are part of the key: a choice timed against another packing is stale
    parts = ("linear", torch.get_num_threads(), sorted(set(shapes)), str(dtype), "blocked", ROW_BUCKETS)
    key = machine_key(*parts)
    choice = remembered(cache_root() / "linear_kernel.json", key,
                        lambda: str(choose_kernel(shapes, dtype=dtype) or "dense"))
    return None if choice == "dense" else int(choice)
