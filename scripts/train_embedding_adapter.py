"""Train a LoRA embedding adapter on the generation backbone (SmolLM2-135M-Instruct), for the shared-backbone mode.

    python scripts/train_embedding_adapter.py --out runs/adapters/smollm2-embed            # ~30-60 min, 2 cores

Pooling: mean over every token of the final normed hidden states, L2-normalised, inputs tokenized by the engine's
own InputProcessor (query prefix "query: ", document prefix "passage: ", no EOS): exactly what the engine computes
for `PoolingParams(pooling="mean", instruction=...)`. Mean, not last-token, because (1) it is chunk-invariant in
the engine like `last` but every token gets a gradient, which matters with a few hundred steps on CPU, and (2) the
bare backbone's engine default is mean, so the table compares like with like.

Data (all made here; no 2WikiMultihopQA or HotpotQA text): questions and paragraphs of the built-in synthetic
multi-hop world (`data/synthetic.py`, seeds from --seed on, fictional people, films and towns). Each training
pair is a question and one of its gold paragraphs; the hard negative is a distractor paragraph of the same
question (entities named in the gold paragraphs come first in the synthetic contexts).

Loss: in-batch-negative InfoNCE (temperature 0.05) over the batch's positives and hard negatives, plus
distillation of all-MiniLM-L6-v2's query-document similarity structure on the same batch (KL between the row
softmaxes of teacher and student similarity matrices, both at temperature 0.05), weighted by --distill.
Seeds are fixed (data, LoRA init, batch order). The adapter folder gets `orthrus_embedding.json` (pooling and
prefixes, read by the engine and scripts/eval_embedding_recall.py) and a `training.json` with the loss curve.

`--full`: the same recipe as a full fine-tune (every weight but the token embeddings, which SmolLM2 ties to its
output head; no weight decay, so untouched directions stay at the base), saved as a checkpoint folder: the "tuned"
side of a real pair for scripts/extract_adapter.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from orthrus_rag.data.synthetic import make_synthetic
from orthrus_rag.embedding_formats import ADAPTER_CARD
from orthrus_rag.engine.text_io import InputProcessor
from orthrus_rag.models.registry import resolve_model_path
from orthrus_rag.params import PoolingParams

logger = logging.getLogger("train_embedding_adapter")
QUERY_PREFIX, DOC_PREFIX = "query: ", "passage: "
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Triple:
    query: str
    positive: str
    negative: str


def make_triples(num_questions: int, seed: int) -> list[Triple]:
    """(question, gold paragraph, hard distractor) from synthetic worlds of seeds `seed`, `seed + 1`, ..."""
    rng = random.Random(seed)
    triples: list[Triple] = []
    world_seed = seed
    while len(triples) < num_questions:
        for ex in make_synthetic(num_questions=min(200, num_questions), seed=world_seed):
            gold = [p for p in ex.context if p.title in ex.supporting_titles]
            other = [p for p in ex.context if p.title not in ex.supporting_titles]
            if gold and other:
                triples.append(Triple(ex.question, rng.choice(gold).contents, other[0].contents))
        world_seed += 1
    return triples[:num_questions]


class Pooler:
    """The engine's tokenization and mean pooling, on a HF/PEFT model (train mode, gradients on)."""

    def __init__(self, tokenizer, vocab_size: int, max_len: int) -> None:
        self.inputs = InputProcessor(tokenizer, vocab_size, max_model_len=10**9, max_kv_tokens=10**9)
        self.max_len = max_len

    def ids(self, texts: list[str], prefix: str) -> list[list[int]]:
        params = PoolingParams(pooling="mean", instruction=prefix)
        return [self.inputs.embed_input(t, params, on_encoder=False)[:self.max_len] for t in texts]

    def __call__(self, body: torch.nn.Module, batch: list[list[int]]) -> torch.Tensor:
        n = max(map(len, batch))
        ids = torch.tensor([b + [0] * (n - len(b)) for b in batch])
        mask = torch.tensor([[1] * len(b) + [0] * (n - len(b)) for b in batch], dtype=torch.float32)
        hidden = body(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # final norm included
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(pooled, dim=-1)


class Teacher:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: mean pooling over 256 tokens at most, L2."""

    def __init__(self, name: str = "all-minilm-l6-v2") -> None:
        from transformers import AutoModel, AutoTokenizer

        path = resolve_model_path(name)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).eval()

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"][..., None].float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def batch_loss(student_q: torch.Tensor, student_d: torch.Tensor, teacher_q: torch.Tensor | None,
               teacher_d: torch.Tensor | None, temperature: float, distill: float) -> tuple[torch.Tensor, dict]:
    """InfoNCE with query i's positive at column i of [positives; negatives], plus the distillation KL."""
    logits = student_q @ student_d.T / temperature
    contrastive = F.cross_entropy(logits, torch.arange(student_q.shape[0]))
    parts = {"contrastive": float(contrastive.detach())}
    loss = contrastive
    if distill > 0 and teacher_q is not None:
        target = F.softmax(teacher_q @ teacher_d.T / temperature, dim=-1)
        kl = F.kl_div(F.log_softmax(logits, dim=-1), target, reduction="batchmean")
        parts["distill"] = float(kl.detach())
        loss = loss + distill * kl
    return loss, parts


def train_steps(args: argparse.Namespace, triples: list[Triple],
                loss_on: Callable[[list[Triple]], tuple[torch.Tensor, dict]],
                optimizer: torch.optim.Optimizer) -> list[dict]:
    """The recipes' loop: `args.steps` AdamW steps over seeded batches of `args.batch_size` triples (a new seeded
    order each epoch), stopped early past `args.max_minutes`; the loss history."""
    history, start, order = [], time.perf_counter(), list(range(len(triples)))
    rng, cursor = random.Random(args.seed), len(order)
    for step in range(args.steps):
        if cursor + args.batch_size > len(order):  # a new epoch, in a new (seeded) order
            rng.shuffle(order)
            cursor = 0
        batch = [triples[i] for i in order[cursor:cursor + args.batch_size]]
        cursor += args.batch_size
        loss, parts = loss_on(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append({"step": step, "loss": float(loss.detach()), **parts})
        if step % args.log_every == 0:
            logger.info("step %d loss %.4f %s (%.0f s)", step, float(loss.detach()), parts, time.perf_counter() - start)
        if args.max_minutes and time.perf_counter() - start > 60 * args.max_minutes:
            logger.info("stopping at step %d: --max-minutes %s reached", step, args.max_minutes)
            break
    return history


def seeded_model(args: argparse.Namespace) -> tuple[Any, torch.nn.Module]:
    """Both recipes' start: seeds and threads set, then the base model in fp32 and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return tokenizer, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def train(args: argparse.Namespace) -> dict:
    from peft import LoraConfig, get_peft_model

    tokenizer, model = seeded_model(args)
    if args.checkpointing:  # NOTE: activations of 30 layers x 48 sequences are ~8 GB without it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.full:
        for name, param in model.named_parameters():
            param.requires_grad = "embed_tokens" not in name
        peft_model, body = model, model.model
    else:
        peft_model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                      target_modules=TARGETS))
        body = peft_model.base_model.model.model  # the decoder body: final normed hidden states, as the engine pools
    pooler = Pooler(tokenizer, model.config.vocab_size, args.max_len)
    teacher = Teacher(args.teacher) if args.distill > 0 else None
    triples = make_triples(args.num_questions, args.seed)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.0 if args.full else 0.01)
    probe = triples[:args.batch_size]  # a fixed batch: its loss before and after says whether training helped

    def loss_on(batch: list[Triple]) -> tuple[torch.Tensor, dict]:
        q = pooler(body, pooler.ids([t.query for t in batch], QUERY_PREFIX))
        docs = [t.positive for t in batch] + [t.negative for t in batch]
        d = pooler(body, pooler.ids(docs, DOC_PREFIX))
        tq = teacher([t.query for t in batch]) if teacher else None
        td = teacher(docs) if teacher else None
        return batch_loss(q, d, tq, td, args.temperature, args.distill)

    # NOTE: SmolLM2 and the LoRA have no dropout, so train mode (needed by gradient checkpointing) is deterministic
    peft_model.train()
    with torch.no_grad():
        probe_before = float(loss_on(probe)[0])
    start = time.perf_counter()
    history = train_steps(args, triples, loss_on, optimizer)
    with torch.no_grad():
        probe_after = float(loss_on(probe)[0])
    if args.full:
        tokenizer.save_pretrained(str(args.out))
    return save(args, peft_model, history, probe_before, probe_after, time.perf_counter() - start)


def save(args: argparse.Namespace, peft_model, history: list[dict], before: float, after: float,
         seconds: float) -> dict:
    out: Path = args.out
    peft_model.save_pretrained(str(out))
    config = out / "adapter_config.json"
    if config.is_file():  # NOTE: the base by the name it was given, not this machine's cache folder for it
        config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": args.model},
                                     indent=2))
    # NOTE: halves the folder; the engine casts adapters to its own dtype
    if args.save_dtype != "float32" and not args.full:
        from safetensors.torch import load_file, save_file

        file = out / "adapter_model.safetensors"
        save_file({k: v.to(getattr(torch, args.save_dtype)) for k, v in load_file(str(file)).items()}, str(file))
    (out / ADAPTER_CARD).write_text(json.dumps(
        {"pooling": "mean", "normalize": True, "query_instruction": QUERY_PREFIX,
         "document_instruction": DOC_PREFIX, "append_eos": False}, indent=2))
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "probe_loss_before": before,
               "probe_loss_after": after, "steps": len(history), "seconds": round(seconds, 1), "history": history}
    (out / "training.json").write_text(json.dumps(summary, indent=2))
    logger.info("probe loss %.4f -> %.4f after %d steps (%.0f s); adapter in %s", before, after, len(history),
                seconds, out)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--teacher", default="all-minilm-l6-v2")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--distill", type=float, default=1.0, help="weight of the MiniLM distillation term (0: off)")
    ap.add_argument("--num-questions", type=int, default=4000)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=55.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                    help="keep all activations (faster, several GB more memory)")
    ap.add_argument("--save-dtype", choices=["float32", "float16", "bfloat16"], default="float16",
                    help="the adapter's stored dtype (a --full checkpoint stays float32)")
    ap.add_argument("--full", action="store_true", help="a full fine-tune (a checkpoint folder), not a LoRA")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
