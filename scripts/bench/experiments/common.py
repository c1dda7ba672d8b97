"""What several experiments share: rows from results, the reference systems of the ratio columns."""

from __future__ import annotations

from omegaconf import DictConfig

from ..driver import RunResult, summarize


def as_result(d: dict) -> RunResult:
    from ..driver import RequestRecord

    return RunResult(d["label"], d["window_s"], [RequestRecord(**r) for r in d["records"]], d["steps"],
                     [tuple(c) for c in d["cpu"]], d.get("warmup_s", 0.0))


def rows(results: dict[str, dict[str, dict]], groups: list[str]) -> list[dict]:
    """`summarize()` of every (system, group) run, ordered by group then system, with `system` and `group`."""
    out = []
    for g in groups:
        for system, runs in results.items():
            if g in runs:
                out.append({"system": system, "group": g, **summarize(as_result(runs[g]))})
    return out


def first_peer(cfg: DictConfig, results: dict) -> str | None:
    return next((p for p in cfg.peers if p in results), None)


def by_group(results: dict[str, dict[str, dict]], group: str) -> dict[str, dict]:
    """system -> run of one group (what the latency-CDF and step-mix plots take)."""
    return {system: runs[group] for system, runs in results.items() if group in runs}
