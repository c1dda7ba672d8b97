"""Side-by-side tables of run folders (a Hydra sweep's jobs, or any runs): what each run was (policy x retriever x
dataset) and what it scored (EM, F1, acc, recall@k, q/s, p99 latency). `orthrus-rag summarize` prints them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orthrus_rag.pipelines.run_store import SUMMARY

COLUMNS = ("run", "policy", "retriever", "dataset", "pipeline", "questions", "failed", "EM", "F1", "acc", "recall@k",
           "q/s", "p99 s")


@dataclass
class Run:
    folder: Path
    summary: dict[str, Any]


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Every run folder (one holding summary.json) at or under `paths`, in path order."""
    runs: list[Run] = []
    for root in map(Path, paths):
        if not root.exists():
            raise ValueError(f"no such folder: {root}")
        files = [root / SUMMARY] if (root / SUMMARY).is_file() else sorted(root.rglob(SUMMARY), key=_natural)
        for path in files:
            try:
                runs.append(Run(path.parent, json.loads(path.read_text(encoding="utf-8"))))
            except ValueError as exc:
                raise ValueError(f"{path} is not a run summary: {exc}") from exc
    return runs


def _natural(path: Path) -> list[Any]:
    """Sort job folders 0, 1, ..., 10 as numbers."""
    return [int(part) if part.isdigit() else part for part in path.parts]


def _num(x: Any, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def row(run: Run, base: Path | None = None) -> list[str]:
    s, c = run.summary, run.summary.get("config", {})
    try:
        name = str(run.folder.relative_to(base)) if base is not None else str(run.folder)
    except ValueError:
        name = str(run.folder)
    k = c.get("k")
    recall = s.get(f"recall@{k}")
    if recall is None:  # k past the reported ones: the largest reported
        keys = sorted((key for key in s if key.startswith("recall@")), key=lambda key: int(key.split("@")[1]))
        k, recall = (keys[-1].split("@")[1], s[keys[-1]]) if keys else (k, None)
    dataset = c.get("dataset", "?") + (f"[:{c['limit']}]" if c.get("limit") else "")
    total = s.get("num_total")
    questions = f"{s['num_questions']}" + (f"/{total}" if total and total != s["num_questions"] else "")
    serving = c.get("serving", "")
    policy = c.get("policy", "?") if serving.startswith("engine") or not serving else serving.split(" ")[0]
    return [name or ".", policy, f"{c.get('index_type', '?')} k={c.get('k', '?')}", dataset, c.get("pipeline", "?"),
            questions, str(s.get("num_failed", 0)), _num(s.get("em")), _num(s.get("f1")), _num(s.get("acc")),
            f"{_num(recall)} @{k}" if recall is not None else "-", _num(s.get("throughput_qps")),
            _num(s.get("latency_s", {}).get("p99"), 1)]


def sweep_table(runs: list[Run], base: Path | None = None) -> str:
    """A Markdown table, one row per run."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r, base)) + " |" for r in runs]
    return "\n".join(lines)
