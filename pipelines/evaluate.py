"""Summaries of a pipeline run: answer quality, retrieval recall, latency per question and per stage,
throughput; written to the run folder as JSONL + JSON and rendered as a table."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orthrus_rag.pipelines.metrics import percentiles
from orthrus_rag.pipelines.records import QARecord


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(records: Sequence[QARecord], wall_time_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    summary: dict[str, Any] = {
        "num_questions": len(records),
        "num_failed": len(records) - len(ok),
        "em": _mean([r.em for r in ok]),
        "f1": _mean([r.f1 for r in ok]),
        "wall_time_s": wall_time_s,
        "throughput_qps": len(ok) / wall_time_s if wall_time_s > 0 else float("nan"),
        "latency_s": percentiles([r.latency_s for r in ok]),
        "retrieve_s": percentiles([it.retrieve_s for r in ok for it in r.iterations]),
        "generate_s": percentiles([it.generate_s for r in ok for it in r.iterations]),
    }
    for key in sorted({k for r in ok for k in r.recall}):
        vals = [r.recall[key] for r in ok if r.recall.get(key) is not None]
        summary[key] = _mean(vals)
    by_type: dict[str, list[QARecord]] = {}
    for r in ok:
        by_type.setdefault(r.type or "-", []).append(r)
    summary["by_type"] = {t: {"n": len(rs), "em": _mean([r.em for r in rs]), "f1": _mean([r.f1 for r in rs])}
                          for t, rs in sorted(by_type.items())}
    return summary


def write_run(folder: str | Path, records: Sequence[QARecord], summary: dict[str, Any]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "records.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
    (folder / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    return folder


def format_table(summary: dict[str, Any]) -> str:
    def num(x: float) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    rows = [("questions", str(summary["num_questions"])), ("failed", str(summary["num_failed"])),
            ("EM", num(summary["em"])), ("F1", num(summary["f1"]))]
    rows += [(k, num(v)) for k, v in summary.items() if k.startswith("recall@")]
    rows += [("throughput (q/s)", num(summary["throughput_qps"])), ("wall time (s)", num(summary["wall_time_s"]))]
    for stage in ("latency_s", "retrieve_s", "generate_s"):
        p = summary[stage]
        rows.append((f"{stage} p50/p95/p99", " / ".join(num(p[q]) for q in ("p50", "p95", "p99"))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
