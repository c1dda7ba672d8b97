"""Adapter extraction: a tuned model that is its base plus rank-r Linear deltas (and full norm / embedding-row
deltas) comes back exactly through the engine's LoRA path; a lower rank loses energy and logits."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from orthrus_rag import PoolingParams
from orthrus_rag.layers.lora import attach_adapters, load_peft_adapter
from orthrus_rag.layers.row_deltas import FULL_DELTAS_FILE
from orthrus_rag.models.adapter_extraction import ExtractionReport, extract, read_checkpoint, write_adapter
from orthrus_rag.models.loader import load_decoder
from tests.test_model_parity import ATOL, SEQ_LEN, _build, _engine, _engine_logits, _hf_logits, _ids

pytestmark = pytest.mark.slow  # builds engines (make test-fast skips it)

RANK = 4
EXACT = 2.5e-5
ALL = PoolingParams(pooling="all", normalize=False, adapter="tuned")


def _tune(hf: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`hf` plus a rank-RANK delta on every Linear of the layers, and full deltas on every norm and 5 embedding
    rows: what a fine-tune with an exactly low-rank update would leave."""
    gen = torch.Generator().manual_seed(seed)
    tuned = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in tuned.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                out_f, in_f = module.weight.shape
                b, a = torch.randn(out_f, RANK, generator=gen), torch.randn(RANK, in_f, generator=gen)
                module.weight += 0.05 * b @ a / RANK
            elif "norm" in name.rsplit(".", 1)[-1]:
                module.weight += 0.1 * torch.randn(module.weight.shape, generator=gen)
        rows = torch.tensor([3, 17, 42, 99, 200])
        tuned.model.embed_tokens.weight[rows] += 0.1 * torch.randn(5, tuned.config.hidden_size, generator=gen)
    return tuned


@pytest.fixture(scope="module", params=["qwen3_qk_norm", "gemma3_alternating"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp(request.param)
    hf, _ = _build(request.param, tmp / "base")
    tuned = _tune(hf, seed=5)
    tuned.save_pretrained(str(tmp / "tuned"))
    return dict(tmp=tmp, hf=hf, tuned=tuned, base_sd=read_checkpoint(tmp / "base"),
                tuned_sd=read_checkpoint(tmp / "tuned"))


def _run_script(argv: list[str]) -> None:
    path = Path(__file__).resolve().parents[1] / "scripts" / "extract_adapter.py"
    spec = importlib.util.spec_from_file_location("extract_adapter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def _adapter_logits(base_dir: Path, adapter_dir: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(adapter rows, bare rows) logits of one sequence through one engine with the adapter attached, and the
    engine. NOTE: logits through the base lm_head: embedding rows never reach the head, and with tied
    embeddings (Gemma) a tuned table would change the head too."""
    ours = load_decoder(base_dir)
    engine = _engine(ours, 7)
    engine.adapter_slots = attach_adapters(ours, [load_peft_adapter(adapter_dir, name="tuned")])
    (with_adapter,) = engine.embed([ids], ALL)
    (bare,) = engine.embed([ids], PoolingParams(pooling="all", normalize=False, adapter=""))
    return _engine_logits(engine, with_adapter), _engine_logits(engine, bare), engine


@torch.no_grad()
def _hf_hidden(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf.model(torch.tensor([ids])).last_hidden_state[0].float()


def test_rank_r_delta_recovered_exactly(pair: dict, capsys: pytest.CaptureFixture) -> None:
    out = pair["tmp"] / "adapter"
    _run_script([str(pair["tmp"] / "base"), str(pair["tmp"] / "tuned"), str(out), "--rank", str(RANK)])
    report = json.loads((out / "extraction_report.json").read_text())
    assert report["energy_kept_per_layer"] and all(v > 1 - 1e-9 for v in report["energy_kept_per_layer"].values())
    assert "layer     0: 1.0000" in capsys.readouterr().out
    assert (out / FULL_DELTAS_FILE).is_file()
    full = {m["name"] for m in report["full"]}
    assert "model.embed_tokens.weight" in full and "model.layers.0.self_attn.q_norm.weight" in full

    ids = _ids(SEQ_LEN, 0) + [3, 17, 42]  # includes embedding rows that changed
    got, bare, engine = _adapter_logits(pair["tmp"] / "base", out, ids)
    # against our own decoder running the tuned checkpoint: only the factorisation and reduction order differ
    tuned_engine = _engine(load_decoder(pair["tmp"] / "tuned"), 7)
    (tuned_out,) = tuned_engine.embed([ids], PoolingParams(pooling="all", normalize=False))
    want = _engine_logits(engine, tuned_out)  # the same (base) head
    # NOTE: relative to the logits' scale: for the Gemma 3 config, merely chunking the same model differently
    # moves its logits (|logit| <= 3) by 1.2e-5 in fp32, so an absolute 1e-5 would test rounding, not extraction.
    # The factorised delta sums in another order again: under 1e-5 relative on the EPYCs, 1.25e-5 on an AMX
    # Xeon's fp32 GEMMs (chunking alone 0.4e-5 there)
    diff = (got - want).abs().max().item()
    assert diff < EXACT * max(1.0, want.abs().max().item()), f"max |logit diff| {diff:.2e} vs the tuned model"
    # and transformers' forward of the tuned model, on the hidden states the embedding pools
    (hidden,) = engine.embed([ids], ALL)
    assert (hidden.embedding - _hf_hidden(pair["tuned"], ids)).abs().max() < ATOL
    assert (bare - _hf_logits(pair["hf"], ids)).abs().max() < ATOL  # other rows: still the base model
    assert (got - bare).abs().max() > 100 * ATOL


def test_lower_rank_loses_energy(pair: dict) -> None:
    lora, full, report = extract(pair["base_sd"], pair["tuned_sd"], rank=RANK // 2)
    per_layer = report.per_layer()
    assert all(0.3 < v < 0.99 for v in per_layer.values()), per_layer
    out = pair["tmp"] / "low"
    write_adapter(out, lora, full, RANK // 2, "base", report)
    ids = _ids(SEQ_LEN, 1)
    _, _, engine = _adapter_logits(pair["tmp"] / "base", out, ids)
    (low,) = engine.embed([ids], ALL)
    assert (low.embedding - _hf_hidden(pair["tuned"], ids)).abs().max() > 100 * ATOL


def test_peft_reads_the_lora_part(pair: dict) -> None:
    """PEFT loads the folder as a LoRA of the base; merged, its Linears are the tuned model's."""
    from peft import PeftModel

    lora, full, report = extract(pair["base_sd"], pair["tuned_sd"], rank=RANK)
    out = pair["tmp"] / "for_peft"
    write_adapter(out, lora, full, RANK, "base", report)
    merged = PeftModel.from_pretrained(copy.deepcopy(pair["hf"]), str(out)).merge_and_unload()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.2.mlp.down_proj"):
        torch.testing.assert_close(merged.get_submodule(name).weight, pair["tuned"].get_submodule(name).weight,
                                   atol=1e-6, rtol=0)


def test_refuses_mismatched_models(pair: dict) -> None:
    tuned = dict(pair["tuned_sd"])
    tuned["model.layers.0.self_attn.q_proj.weight"] = tuned["model.layers.0.self_attn.q_proj.weight"][:, :8]
    with pytest.raises(ValueError, match="q_proj"):
        extract(pair["base_sd"], tuned, RANK)
    with pytest.raises(ValueError, match="nothing to extract"):
        lora, full, report = extract(pair["base_sd"], pair["base_sd"], RANK)
        write_adapter(pair["tmp"] / "none", lora, full, RANK, "base", report)


def test_rewriting_a_folder_leaves_none_of_the_previous_adapter(tmp_path: Path) -> None:
    """An adapter without full deltas, extracted into the folder of one with them, loads without them (the old
    norm deltas would otherwise be applied on top of the new factors); PEFT's older weight file goes too."""
    gen = torch.Generator().manual_seed(0)
    lora = {"model.layers.0.self_attn.q_proj": (torch.randn(RANK, 8, generator=gen),
                                                torch.randn(8, RANK, generator=gen))}
    write_adapter(tmp_path, lora, {"model.norm": torch.randn(8, generator=gen)}, RANK, "base", ExtractionReport(RANK))
    assert set(load_peft_adapter(tmp_path).full_deltas) == {"model.norm"}  # kept when the new adapter has them
    (tmp_path / "adapter_model.bin").write_bytes(b"a previous PEFT save")
    (tmp_path / "README.md").write_text("the user's own notes")

    write_adapter(tmp_path, lora, {}, RANK, "base", ExtractionReport(RANK))
    assert load_peft_adapter(tmp_path).full_deltas == {}
    assert not (tmp_path / FULL_DELTAS_FILE).exists() and not (tmp_path / "adapter_model.bin").exists()
    assert (tmp_path / "README.md").is_file()  # only adapter files are removed
