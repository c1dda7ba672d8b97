"""The embedding-adapter recipe, a few steps on a tiny model: its loss falls, and the adapter folder it writes
loads in the engine, which pools exactly as training did."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from orthrus_rag import Engine, PoolingParams  # noqa: E402


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "train_embedding_adapter.py"
    spec = importlib.util.spec_from_file_location("train_embedding_adapter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol_tokenizer) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer (the recipe tokenizes real text)."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(smol_tokenizer), max_position_embeddings=512,
                      eos_token_id=smol_tokenizer.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    smol_tokenizer.save_pretrained(str(path))
    return path


def test_few_steps_lower_the_loss_and_the_engine_loads_the_adapter(tiny: Path, tmp_path: Path) -> None:
    script = _script()
    out = tmp_path / "adapter"
    summary = script.main(["--out", str(out), "--model", str(tiny), "--steps", "12", "--batch-size", "4",
                           "--num-questions", "8", "--lr", "3e-3", "--rank", "4", "--max-len", "48",
                           "--threads", "0", "--log-every", "100"])
    assert summary["steps"] == 12
    assert summary["probe_loss_after"] < 0.8 * summary["probe_loss_before"], summary
    assert {"contrastive", "distill"} <= set(summary["history"][0])
    card = json.loads((out / "orthrus_embedding.json").read_text())
    assert card["pooling"] == "mean" and card["query_instruction"] == script.QUERY_PREFIX

    # NOTE: fp32, as the fp32 reference below (dtype "auto" is bf16 on a CPU with bf16 dot products: ~1e-5 off)
    engine = Engine.from_pretrained(str(tiny), embedding_adapters=str(out), num_blocks=64,
                                    max_num_batched_tokens=32, max_chunk_tokens=8, dtype="float32")
    text = "Who is the father of the director of film The Secret Orchard?"
    params = PoolingParams(pooling="mean", instruction=card["query_instruction"])
    (adapted,) = engine.embed([text], params)
    (bare,) = engine.embed([text], PoolingParams(pooling="mean", instruction=card["query_instruction"], adapter=""))
    assert len(adapted.prompt_token_ids) > 8  # chunked: pooled across steps

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(out)).merge_and_unload()
    pooler = script.Pooler(AutoTokenizer.from_pretrained(str(tiny)), merged.config.vocab_size, max_len=10**6)
    with torch.no_grad():
        want = pooler(merged.model.eval(), pooler.ids([text], card["query_instruction"]))[0]
    assert pooler.ids([text], card["query_instruction"])[0] == adapted.prompt_token_ids
    assert torch.nn.functional.cosine_similarity(adapted.embedding, want, dim=0) > 0.99999
    assert torch.nn.functional.cosine_similarity(adapted.embedding, bare.embedding, dim=0) < 0.9999


def test_a_full_fine_tune_extracts_back_to_an_adapter_the_engine_serves(tiny: Path, tmp_path: Path) -> None:
    """`--full` trains every weight but the tied token embeddings into a checkpoint folder; extracting its
    difference from the base at full rank (scripts/extract_adapter.py) gives an adapter whose engine embeddings
    are the full model's."""
    from safetensors.torch import load_file

    script = _script()
    full = tmp_path / "full"
    summary = script.main(["--out", str(full), "--model", str(tiny), "--steps", "8", "--batch-size", "4",
                           "--num-questions", "8", "--lr", "1e-3", "--max-len", "48", "--threads", "0",
                           "--log-every", "100", "--full"])
    assert summary["probe_loss_after"] < summary["probe_loss_before"], summary
    tuned, base = load_file(str(full / "model.safetensors")), load_file(str(tiny / "model.safetensors"))
    assert torch.equal(tuned["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # frozen
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(tuned[norm], base[norm])

    path = Path(__file__).resolve().parents[1] / "scripts" / "extract_adapter.py"
    spec = importlib.util.spec_from_file_location("extract_adapter", path)
    extract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extract)
    adapter = tmp_path / "extracted"
    extract.main([str(tiny), str(full), str(adapter), "--rank", "64"])  # 64: the tiny model's width, exact
    assert (adapter / "orthrus_embedding.json").read_text() == (full / "orthrus_embedding.json").read_text()

    text = "Who is the father of the director of film The Secret Orchard?"
    params = PoolingParams(pooling="mean", instruction=script.QUERY_PREFIX)
    opts = dict(num_blocks=64, max_num_batched_tokens=32, max_chunk_tokens=8, dtype="float32")
    (want,) = Engine.from_pretrained(str(full), **opts).embed([text], params)
    (got,) = Engine.from_pretrained(str(tiny), embedding_adapters=str(adapter), **opts).embed([text], params)
    assert torch.nn.functional.cosine_similarity(got.embedding, want.embedding, dim=0) > 0.9999
