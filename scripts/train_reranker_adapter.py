"""Train a LoRA reranker adapter on the generation backbone (SmolLM2-135M-Instruct), read as the engine reads
`model.rerankers=[backbone+ADAPTER]`: the pair in Qwen3-Reranker's judging chat, P("yes") over "yes" and "no" at the
last token (engine/rerankers.py).

    python scripts/train_reranker_adapter.py --out runs/adapters/smollm2-rerank            # ~30-60 min, 2 cores

Inputs are tokenized by the engine's own `BackboneReranker.pair`, so training sees exactly the tokens the engine
scores. Data (all made here; no 2WikiMultihopQA or HotpotQA text): the built-in synthetic multi-hop world
(`data/synthetic.py`, seeds from --seed on), as for the embedding adapter: a question, one of its gold paragraphs
(label yes) and a distractor paragraph of the same question (label no). Loss: binary cross-entropy of each pair's
yes-no logit difference against its label, plus, per question, the cross-entropy of its gold paragraph against its
distractor (a listwise term over the two). Seeds are fixed (data, LoRA init, batch order).

Held out: questions of worlds from --eval-seed on (never trained on). Before and after training, each held-out
question's gold and distractor are scored and `training.json` records the pairwise accuracy (gold above distractor)
and the mean score of each. The folder gets `orthrus_reranker.json` (the form and instruction it was trained in).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_embedding_adapter import TARGETS, Triple, make_triples, seeded_model, train_steps  # noqa: E402 (a sibling script)

from orthrus_rag.engine.rerankers import DEFAULT_INSTRUCTION, BackboneReranker  # noqa: E402
from orthrus_rag.params import RerankParams  # noqa: E402

logger = logging.getLogger("train_reranker_adapter")
RERANKER_CARD = "orthrus_reranker.json"


class Pairs:
    """The engine's pair tokens, and the yes-no logit difference at each pair's last token on a HF/PEFT model."""

    def __init__(self, tokenizer, max_len: int) -> None:
        self.reader = BackboneReranker("train", tokenizer, None, torch.float32, max_len)
        self.no, self.yes = self.reader.yes_no
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def ids(self, query: str, document: str) -> list[int]:
        return self.reader.pair(query, document, RerankParams()).token_ids

    def margins(self, model: torch.nn.Module, batch: list[list[int]]) -> torch.Tensor:
        n = max(map(len, batch))
        ids = torch.tensor([b + [self.pad] * (n - len(b)) for b in batch])
        mask = torch.tensor([[1] * len(b) + [0] * (n - len(b)) for b in batch])
        logits = model(input_ids=ids, attention_mask=mask).logits  # right padding: a row's last real token
        last = logits[torch.arange(len(batch)), torch.tensor([len(b) - 1 for b in batch])]
        return (last[:, self.yes] - last[:, self.no]).float()


def batch_loss(pairs: Pairs, model: torch.nn.Module, batch: list[Triple]) -> tuple[torch.Tensor, dict]:
    ids = [pairs.ids(t.query, t.positive) for t in batch] + [pairs.ids(t.query, t.negative) for t in batch]
    m = pairs.margins(model, ids)
    n = len(batch)
    labels = torch.cat([torch.ones(n), torch.zeros(n)])
    pointwise = F.binary_cross_entropy_with_logits(m, labels)
    listwise = F.cross_entropy(torch.stack([m[:n], m[n:]], dim=1), torch.zeros(n, dtype=torch.long))
    loss = pointwise + listwise
    return loss, {"pointwise": float(pointwise.detach()), "listwise": float(listwise.detach())}


@torch.no_grad()
def held_out(pairs: Pairs, model: torch.nn.Module, triples: list[Triple], batch_size: int) -> dict:
    """Gold above distractor, and the mean P(yes) of each, over held-out questions."""
    gold, other = [], []
    for start in range(0, len(triples), batch_size):
        part = triples[start:start + batch_size]
        ids = [pairs.ids(t.query, t.positive) for t in part] + [pairs.ids(t.query, t.negative) for t in part]
        p = torch.sigmoid(pairs.margins(model, ids))
        gold += p[:len(part)].tolist()
        other += p[len(part):].tolist()
    return {"pairwise_accuracy": sum(g > o for g, o in zip(gold, other)) / len(gold),
            "mean_gold": sum(gold) / len(gold), "mean_distractor": sum(other) / len(other), "questions": len(gold)}


def train(args: argparse.Namespace) -> dict:
    from peft import LoraConfig, get_peft_model

    tokenizer, model = seeded_model(args)
    peft_model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                  target_modules=TARGETS))
    pairs = Pairs(tokenizer, args.max_len)
    triples = make_triples(args.num_questions, args.seed)
    evaluation = make_triples(args.eval_questions, args.eval_seed)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.01)
    peft_model.train()  # NOTE: no dropout anywhere, so train mode is deterministic
    before = held_out(pairs, peft_model, evaluation, args.batch_size)
    logger.info("held out before: %s", before)
    start = time.perf_counter()
    history = train_steps(args, triples, lambda batch: batch_loss(pairs, peft_model, batch), optimizer)
    seconds = time.perf_counter() - start
    after = held_out(pairs, peft_model, evaluation, args.batch_size)
    logger.info("held out after: %s", after)
    return save(args, peft_model, history, before, after, seconds)


def save(args: argparse.Namespace, peft_model, history: list[dict], before: dict, after: dict,
         seconds: float) -> dict:
    from safetensors.torch import load_file, save_file

    out: Path = args.out
    peft_model.save_pretrained(str(out))
    config = out / "adapter_config.json"
    # NOTE: the base by the name it was given, not this machine's cache folder for it
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": args.model}, indent=2))
    file = out / "adapter_model.safetensors"  # NOTE: half the size; the engine casts adapters to its own dtype
    save_file({k: v.to(torch.float16) for k, v in load_file(str(file)).items()}, str(file))
    (out / RERANKER_CARD).write_text(json.dumps({"form": "yes_no", "instruction": DEFAULT_INSTRUCTION}, indent=2))
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "held_out_before": before,
               "held_out_after": after, "steps": len(history), "seconds": round(seconds, 1), "history": history}
    (out / "training.json").write_text(json.dumps(summary, indent=2))
    logger.info("held-out pairwise accuracy %.3f -> %.3f after %d steps (%.0f s); adapter in %s",
                before["pairwise_accuracy"], after["pairwise_accuracy"], len(history), seconds, out)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8, help="questions per step (two pairs each)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--num-questions", type=int, default=4000)
    ap.add_argument("--eval-questions", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=256, help="a pair's tokens at most (the document is cut)")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--eval-seed", type=int, default=9000, help="the held-out worlds' first seed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=55.0)
    ap.add_argument("--log-every", type=int, default=10)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
