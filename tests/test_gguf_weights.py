"""A GGUF file's weights read one tensor at a time (models/gguf_weights.py) and loaded layer by layer
(models/loader.py): names, llama.cpp's Q/K row order undone as transformers undoes it, Q8_0 and F32 blocks, tables
read in row pieces; the shipped Q4_1 file read directly equals its conversion through transformers, parameter for
parameter; quantizing by row pieces equals quantizing the whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orthrus_rag.layers import quantized
from orthrus_rag.layers.quantized import quantize_rows
from orthrus_rag.models.gguf_weights import GGUFWeights

HIDDEN, HEADS, KV_HEADS, VOCAB = 64, 4, 2, 96


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for a Llama model's Q/K (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A one-layer Llama GGUF: Q/K/V/O and the token embeddings in Q8_0, the output head in F32, norms in F32;
    returns (path, the weights by the decoder's names before llama.cpp's permutation)."""
    import gguf

    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    hf = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)),
          "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((HIDDEN, HIDDEN)),
          "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((KV_HEADS * head_dim, HIDDEN)),
          "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((KV_HEADS * head_dim, HIDDEN)),
          "model.layers.0.input_layernorm.weight": rng.standard_normal(HIDDEN),
          "lm_head.weight": rng.standard_normal((VOCAB, HIDDEN))}
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    stored = {"token_embd.weight": (hf["model.embed_tokens.weight"], "Q8_0"),
              "blk.0.attn_q.weight": (_llamacpp_permute(hf["model.layers.0.self_attn.q_proj.weight"], HEADS), "Q8_0"),
              "blk.0.attn_k.weight": (_llamacpp_permute(hf["model.layers.0.self_attn.k_proj.weight"], KV_HEADS),
                                      "Q8_0"),
              "blk.0.attn_v.weight": (hf["model.layers.0.self_attn.v_proj.weight"], "F32"),
              "blk.0.attn_norm.weight": (hf["model.layers.0.input_layernorm.weight"], "F32"),
              "output.weight": (hf["lm_head.weight"], "F32")}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name, (values, form) in stored.items():
        qtype = gguf.GGMLQuantizationType[form]
        data = gguf.quants.quantize(values, qtype) if form != "F32" else values
        writer.add_tensor(name, data, raw_dtype=qtype if form != "F32" else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # what the file holds for Q and K, dequantized, in llama.cpp's row order
    held = {name: gguf.quants.dequantize(gguf.quants.quantize(stored[name][0], gguf.GGMLQuantizationType.Q8_0),
                                         gguf.GGMLQuantizationType.Q8_0) for name in ("blk.0.attn_q.weight",
                                                                                      "blk.0.attn_k.weight")}
    return path, hf, held


def test_names_forms_and_the_qk_order_undone(tiny_gguf):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    path, hf, held = tiny_gguf
    weights = GGUFWeights(path, 1, HEADS, KV_HEADS)
    assert weights.tensor_type("model.layers.0.self_attn.q_proj.weight") == "Q8_0"
    assert weights.file_name("lm_head.weight") == "output.weight"
    assert not weights.has("model.layers.0.mlp.up_proj.weight")
    # transformers' own reader undoes the permutation the same way (the oracle)
    reverse = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    for name, heads, file_name in (("model.layers.0.self_attn.q_proj.weight", HEADS, "blk.0.attn_q.weight"),
                                   ("model.layers.0.self_attn.k_proj.weight", KV_HEADS, "blk.0.attn_k.weight")):
        got = weights.get(name)
        want = reverse._reverse_permute_weights(held[file_name], HEADS, heads)
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))
        # and the rows are the model's own, within Q8_0's error (a scale per 32 weights, 8 bits)
        torch.testing.assert_close(got, torch.from_numpy(hf[name]), atol=0.05, rtol=0)
    assert torch.equal(weights.get("lm_head.weight"), torch.from_numpy(hf["lm_head.weight"]))  # F32: exact
    table = weights.get("model.embed_tokens.weight")
    assert torch.equal(weights.rows("model.embed_tokens.weight", 10, 50), table[10:50])
    with pytest.raises(KeyError, match="no tensor for model.layers.0.mlp.up_proj.weight"):
        weights.get("model.layers.0.mlp.up_proj.weight")


def test_a_tied_head_is_read_from_the_token_embeddings(tmp_path):
    import gguf

    path = tmp_path / "tied.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((VOCAB, HIDDEN), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = GGUFWeights(path, 1, HEADS, KV_HEADS)
    assert not weights.has("lm_head.weight") and weights.has("model.embed_tokens.weight")


def test_an_architecture_not_read_directly_is_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gemma3' is not read directly"):
        GGUFWeights(path, 1, HEADS, KV_HEADS)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantizing_by_row_pieces_equals_the_whole(kind, monkeypatch):
    monkeypatch.setattr(quantized, "ROW_CHUNK", 64)
    weight = torch.randn(208, 96)  # the last piece shorter than the others
    whole = quantized.QUANTIZERS[kind](weight, torch.bfloat16)
    pieces = quantize_rows(lambda a, b: weight[a:b], 208, kind, torch.bfloat16)
    assert torch.equal(pieces.weight, whole.weight) and torch.equal(pieces.scales, whole.scales)
    assert (pieces.in_features, pieces.out_features) == (96, 208)


@pytest.mark.slow
def test_the_shipped_gguf_read_directly_equals_its_conversion():
    """Every parameter of SmolLM2 read from its Q4_1 file directly equals the one transformers' GGUF reader gives
    (the conversion other tools load), in fp32; the engine's layers are stored int4 from the same values."""
    from orthrus_rag.models.loader import load_decoder
    from orthrus_rag.models.registry import cache_root, gguf_meta, gguf_source, resolve_model_path

    name = "smollm2-135m-instruct"
    gguf_path = gguf_source(name)
    direct = load_decoder(gguf_meta(gguf_path, cache_root() / f"{name}.meta"), torch.float32, "cpu", gguf_path)
    converted = load_decoder(resolve_model_path(name), torch.float32, "cpu")
    theirs = dict(converted.named_parameters())
    for key, value in direct.named_parameters():
        assert torch.equal(value, theirs[key]), key


def test_a_gguf_reads_directly_unless_a_conversion_exists(tmp_path, monkeypatch):
    """`decoder_files`: a direct-read architecture gets a folder of its config and tokenizer and the file itself;
    once a conversion exists (a tool asked for a transformers checkpoint), its safetensors are read instead (the
    same weights: the test above)."""
    from orthrus_rag.models.registry import decoder_files

    monkeypatch.setenv("ORTHRUS_RAG_CACHE", str(tmp_path))
    folder, gguf_path = decoder_files("smollm2-135m-instruct")
    assert gguf_path is not None and gguf_path.suffix == ".gguf"
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert not list(folder.glob("*.safetensors"))
    converted = tmp_path / "smollm2-135m-instruct"
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    (converted / "model.safetensors").write_bytes(b"")
    assert decoder_files("smollm2-135m-instruct") == (converted, None)
