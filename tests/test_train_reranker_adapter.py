"""The reranker-adapter recipe, a few steps on a tiny model: its loss falls, and the adapter folder it writes loads
in the engine as `backbone+ADAPTER`, which scores exactly as training reads a pair."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from orthrus_rag import Engine, RerankParams  # noqa: E402
from tests.test_train_embedding_adapter import tiny  # noqa: E402,F401 (the shared tiny model fixture)


def _script():
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    sys.path.insert(0, str(scripts))  # NOTE: the recipe imports its sibling's data helpers
    spec = importlib.util.spec_from_file_location("train_reranker_adapter", scripts / "train_reranker_adapter.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_few_steps_lower_the_loss_and_the_engine_scores_as_training_reads(tiny: Path, tmp_path: Path) -> None:
    script = _script()
    out = tmp_path / "adapter"
    summary = script.main(["--out", str(out), "--model", str(tiny), "--steps", "12", "--batch-size", "4",
                           "--num-questions", "8", "--eval-questions", "4", "--lr", "3e-3", "--rank", "4",
                           "--max-len", "160", "--threads", "0", "--log-every", "100"])
    assert summary["steps"] == 12
    first, last = summary["history"][0]["loss"], summary["history"][-1]["loss"]
    assert last < 0.8 * first, summary["history"]
    assert {"pointwise", "listwise"} <= set(summary["history"][0])
    assert 0.0 <= summary["held_out_after"]["pairwise_accuracy"] <= 1.0
    assert json.loads((out / "orthrus_reranker.json").read_text())["form"] == "yes_no"

    engine = Engine.from_pretrained(str(tiny), num_blocks=64, max_num_batched_tokens=32, max_chunk_tokens=16,
                                    dtype="float32", adapters={"rerank": str(out)},
                                    rerankers=["backbone+rerank", "backbone"])
    query = "Who is the father of the director of film The Secret Orchard?"
    doc = "The Secret Orchard is a film directed by Anna Vell."
    adapted, = engine.score(query, [doc])
    bare, = engine.score(query, [doc], RerankParams(reranker="backbone"))

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(out)).merge_and_unload()
    pairs = script.Pairs(AutoTokenizer.from_pretrained(str(tiny)), 160)
    ids = pairs.ids(query, doc)
    assert len(ids) > 16  # chunked: read across steps
    with torch.no_grad():
        want = float(torch.sigmoid(pairs.margins(merged.eval(), [ids]))[0])
    assert adapted == pytest.approx(want, abs=1e-4)
    assert abs(adapted - bare) > 1e-4
