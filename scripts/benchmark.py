"""Run one benchmark experiment of the paper (every system and peer through the same load driver) and write its
report: results.json, table.md and the plots. Hydra-configured: scripts/bench/conf/bench.yaml holds the shared
settings, each experiment module's CONFIG (scripts/bench/experiments/<name>.py) its own.

    python scripts/benchmark.py experiment=ratio_sweep        # -> runs/bench/ratio_sweep/{results.json,table.md,*.png}
    python scripts/benchmark.py experiment=three_phase
    python scripts/benchmark.py experiment=fcfs_blocking
    python scripts/benchmark.py experiment=poisson
    python scripts/benchmark.py experiment=iter_retgen experiment.dataset_path=dev.jsonl  # 2WikiMultihopQA dev
    python scripts/benchmark.py experiment=chunk_equivalence
    python scripts/benchmark.py experiment=rerank_mix     # rerank calls beside chat and embeddings (orthrus, dedicated)

Override anything on the command line, e.g. `systems=[orthrus,dedicated] peers=[] experiment.duration_s=10`;
`report_only=true` redraws table.md and the plots from the run's results.json (experiments that store `runs`).
Systems run one after another on the same machine; nothing else should run meanwhile (the figures are times).
Workloads, peers and the figures measured so far: docs/benchmarks/ (methodology.md, ratio-sweep.md,
paper-experiments.md); `python scripts/bench/report.py docs/benchmarks/results/<name>.json` redraws a committed
result's plots.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `bench` is scripts/bench/

import hydra  # noqa: E402
from bench.harness import register_experiments, run_experiment  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

logger = logging.getLogger("benchmark")


def run(cfg: DictConfig) -> Path:
    """Run `cfg.experiment.name` and write its report to `cfg.out` (tests call this with a composed config)."""
    name = cfg.experiment.name
    exp = importlib.import_module(f"bench.experiments.{name}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if cfg.get("report_only"):  # redraw the tables and plots from an earlier run's results.json
        import json

        exp.report(cfg, json.loads((out / "results.json").read_text())["runs"], out)
        return out
    logger.info("experiment %s -> %s\n%s", name, out, OmegaConf.to_yaml(cfg))
    if hasattr(exp, "run_system"):  # a load experiment: every system and peer through the same driver
        exp.report(cfg, run_experiment(cfg, exp, name), out)
    else:  # one that drives its own runs (iter_retgen, chunk_equivalence)
        exp.main(cfg, out)
    logger.info("experiment %s done in %.0f s; report in %s", name, time.monotonic() - t0, out)
    return out


@hydra.main(version_base="1.3", config_path="bench/conf", config_name="bench")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":  # NOTE: deployments spawn worker processes, which re-import this module
    register_experiments()
    main()
