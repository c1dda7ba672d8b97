"""What the GPU set (tests/test_gpu_*.py, marker `gpu`) shares: where it runs, and random models saved as real
checkpoints (safetensors, config, a word-level tokenizer) so every engine there is built the way users build one
(`Engine.from_config`: CUDA defaults, compiled kernels, CUDA graphs, the cost budget).

It needs only torch, transformers, safetensors and pytest: the GPU machine has no hydra, faiss, datasets or
langchain, and no model weights (GPU.md). `ORTHRUS_GPU_TESTS_DEVICE=cpu` runs the set on the CPU with small
models, a dry run of the test code only: checks of CUDA features skip there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

DEVICE = torch.device(os.environ.get("ORTHRUS_GPU_TESTS_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda" and torch.cuda.is_available()
DRY_RUN = DEVICE.type == "cpu"

# every test of the set: marked `gpu`, skipped without CUDA unless it is a dry run
gpu = [pytest.mark.gpu, pytest.mark.skipif(not (ON_CUDA or DRY_RUN), reason="the GPU set needs CUDA")]
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="checks a CUDA feature (dry run on the CPU)")

SMOL_VOCAB = 49152
EOS = 2


def smol_config(num_layers: int | None = None) -> LlamaConfig:
    """SmolLM2-135M's shape (30 layers, hidden 576, 9 / 3 heads, tied embeddings); 2 layers in a dry run."""
    return LlamaConfig(vocab_size=SMOL_VOCAB, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=num_layers or (2 if DRY_RUN else 30), num_attention_heads=9,
                       num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                       # NOTE: wider than the default 0.02, so logits are far from tied (GPU.md's probe used 0.05)
                       initializer_range=0.05)


def save_random_model(config: PretrainedConfig, folder: Path, seed: int = 0) -> Path:
    """A random-initialised transformers checkpoint of `config` with a word-level tokenizer (tokens are the
    decimal ids: tests pass token ids, the engine decodes with it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(str(folder))
    vocab = {str(i): i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=str(config.eos_token_id), unk_token="0",
                            pad_token="0").save_pretrained(str(folder))
    return folder


def smol_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bool]:
    """The real SmolLM2 (a converted folder: $ORTHRUS_SMOL, else the GGUF conversion cache) where one is on this
    machine, else a random model of its shape; and whether it is the real one."""
    from orthrus_rag.models.registry import cache_root

    real = Path(os.environ.get("ORTHRUS_SMOL", cache_root() / "smollm2-135m-instruct"))
    if not DRY_RUN and (real / "config.json").is_file() and any(real.glob("*.safetensors")):
        return real, True
    return save_random_model(smol_config(), tmp_path_factory.mktemp("smol")), False


def hf_model(folder: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(DEVICE).eval()


def engine(folder: Path, **options: object):
    """An engine on DEVICE built as users build one; `options` override EngineConfig fields by name."""
    from orthrus_rag import Engine
    from orthrus_rag.config.build import engine_config

    options.setdefault("kv_cache_gib", 2.0 if ON_CUDA else 0.1)
    return Engine.from_config(engine_config(str(folder), device=str(DEVICE), **options))


def ids(n: int, seed: int, vocab: int = SMOL_VOCAB) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_released(eng) -> None:
    """Every KV block is free and no request is left."""
    assert not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
