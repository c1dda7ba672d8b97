"""Write a FlashRAG JSONL corpus (`{"id", "contents": "title\\ntext"}` a line; `.gz` when the name ends so): the
context paragraphs of QA dataset files, de-duplicated by title across them, plus seeded generated passages
(data/generated_corpus.py) for scale tests.

    # a 2WikiMultihopQA dev file's paragraphs plus 200k generated passages, for
    # `orthrus-rag index corpus=jsonl corpus.path=...`
    .venv/bin/python scripts/make_corpus.py --out runs/corpus/2wiki_200k.jsonl.gz \\
        --dataset 2wiki=dev.jsonl --generate 200000
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from orthrus_rag.data import DATASETS, load_qa
from orthrus_rag.data.generated_corpus import generate_passages

logger = logging.getLogger("make_corpus")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write (.jsonl or .jsonl.gz)")
    parser.add_argument("--dataset", action="append", default=[], metavar="NAME=PATH",
                        help=f"a QA dataset file whose context paragraphs to export ({', '.join(DATASETS)}); repeat")
    parser.add_argument("--generate", type=int, default=0, help="generated passages to append")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mean-words", type=int, default=100, help="generated passages' mean length in words")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    seen: set[str] = set()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    raw = gzip.open(args.out, "wb") if args.out.suffix == ".gz" else args.out.open("wb")
    n = 0
    with io.TextIOWrapper(raw, encoding="utf-8") as out:
        for spec in args.dataset:
            name, sep, path = spec.partition("=")
            if not sep or name not in DATASETS:
                parser.error(f"--dataset takes NAME=PATH with NAME one of {', '.join(DATASETS)}; got {spec!r}")
            kept = 0
            for ex in load_qa(name, path=path):
                for p in ex.context:
                    if p.title not in seen:  # NOTE: the same article recurs across questions and datasets
                        seen.add(p.title)
                        out.write(json.dumps({"id": f"{name}-{kept}", "contents": f"{p.title}\n{p.text}"},
                                             ensure_ascii=False) + "\n")
                        kept += 1
            logger.info("%s: %d paragraphs", name, kept)
            n += kept
        for p in tqdm(generate_passages(args.generate, args.seed, mean_words=args.mean_words), total=args.generate,
                      desc="generating", unit="passage", disable=not sys.stderr.isatty()):
            out.write(json.dumps({"id": p.id, "contents": f"{p.title}\n{p.text}"}) + "\n")
        n += args.generate
    logger.info("wrote %d passages to %s", n, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
