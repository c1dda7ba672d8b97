"""Runs one experiment's workload against one peer and writes its RunResults as JSON (called by harness.py
under the peer's interpreter, e.g. `.venv-peers/bin/python` for vLLM)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--experiment", required=True)
    ap.add_argument("--system", required=True)
    ap.add_argument("--config", required=True, help="the resolved experiment config as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so `bench` imports as a package
    from omegaconf import OmegaConf

    from bench.harness import run_local

    cfg = OmegaConf.create(json.loads(Path(args.config).read_text()))
    exp = importlib.import_module(f"bench.experiments.{args.experiment}")
    Path(args.out).write_text(json.dumps(run_local(args.system, cfg, exp), default=str))


if __name__ == "__main__":  # NOTE: spawn (the vLLM peer's engines) re-imports the main module
    main()
