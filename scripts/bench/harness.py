"""Runs one experiment over every configured system, side by side, and the peers in their own interpreter.

A load experiment module (scripts/bench/experiments/) provides

- `run_system(session, cfg) -> {group: RunResult}`: its workload against one system (a group is e.g. a mix or
  an arrival rate; `session.reset()` gives a fresh system when leftovers would spoil the next group), and
- `report(cfg, results, out)`: JSON, markdown and PNGs from `{system: {group: RunResult dict}}`;
`scripts/benchmark.py` calls `run_experiment` and then `report`. Experiments that drive their own runs
(iter_retgen, chunk_equivalence) provide `main(cfg, out)` instead. Every experiment module has a `CONFIG` (YAML: its
settings over bench.yaml's), which scripts/benchmark.py registers as the option `experiment=<module name>`.

Every system is an `EngineClient` (`open_client` for this project's policies and deployments, `RemoteClient` for
`remote:<base URL>`, a running server; `DeploymentClient` over a peer); a peer (`vllm`, `hf`) runs the same
`run_system` in a subprocess (`scripts/peer.py experiment`) under `peers_python` (vLLM lives in its own venv:
`make peers`) and hands back its results as JSON, so every system of one experiment is measured by the same driver
code in the same command.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from orthrus_rag.engine.clients import SYSTEMS, EngineClient, RemoteClient, open_client
from orthrus_rag.config.build import engine_config_from
from orthrus_rag.config import SloConfig

from .driver import RunResult
from .peer_client import PEERS, peer_client
from .workloads import Workload, make_request

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = Path(__file__).resolve().parent / "experiments"


def register_experiments() -> list[str]:
    """Each module of scripts/bench/experiments/ as an option of the Hydra group `experiment` of bench.yaml: its
    CONFIG over bench.yaml's settings (at the global package, so it may set any key). Whatever composes bench.yaml
    calls this first. Returns their names."""
    import importlib

    from hydra.core.config_store import ConfigStore

    names = sorted(p.stem for p in EXPERIMENTS.glob("*.py") if not p.stem.startswith("_"))
    for name in names:
        config = importlib.import_module(f".experiments.{name}", __package__).CONFIG
        ConfigStore.instance().store(group="experiment", name=name, node=OmegaConf.create(config),
                                     package="_global_")
    return names


class Session:
    """One system under test: its client, rebuilt on `reset()`, and the one event loop every run of it uses (a
    client binds to the loop of its first request)."""

    def __init__(self, name: str, factory: Callable[[], EngineClient]) -> None:
        self.name, self._factory = name, factory
        self._runner = asyncio.Runner()
        self.client = factory()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a driver (or any coroutine over `self.client`) to its end."""
        return self._runner.run(coro)

    def reset(self) -> None:
        self.run(self.client.aclose())
        self.client = self._factory()

    def shutdown(self) -> None:
        try:
            self.run(self.client.aclose())
        finally:
            self._runner.close()


UNBOUNDED = 1 << 20
REMOTE = "remote:"  # a system named remote:<base URL>: a running `orthrus-rag serve`, through its EngineClient
# a system named <policy>+slo: that in-process system with bench.yaml's `slo` latency targets as its scheduler.slo
# (`systems=[orthrus,orthrus+slo]` runs the untargeted policy beside the targeted one in one sweep)
WITH_TARGETS = "+slo"


def system_factory(system: str, cfg: DictConfig) -> Callable[[], EngineClient]:
    if system.startswith(REMOTE):
        url = system.removeprefix(REMOTE)
        return lambda: RemoteClient(url, max_in_flight=cfg.experiment.get("clients", 64))
    if system in PEERS:
        opts = cfg.peer_options.get(system)
        kwargs = OmegaConf.to_container(opts, resolve=True) if isinstance(opts, DictConfig) else dict(opts or {})
        return lambda: peer_client(system, embed_model=cfg.model.name, temperature=cfg.workload.temperature,
                                   **kwargs)  # type: ignore[arg-type]
    base = system.removesuffix(WITH_TARGETS)
    if base not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; expected one of {', '.join((*SYSTEMS, *PEERS))}, "
                         f"<policy>{WITH_TARGETS} or {REMOTE}<base URL>")
    threads = tuple(cfg.threads.split) if base in ("dedicated", "disagg-pd") else cfg.threads.inproc
    config = engine_config_from(cfg)  # bench.yaml's model, cache and scheduler nodes, as the CLI's
    if base != system:
        targets = SloConfig(**OmegaConf.to_container(cfg.slo, resolve=True))
        config = replace(config, scheduler=replace(config.scheduler, policy=base, slo=targets))
    system = base
    # NOTE: a load driver bounds what is in flight itself; the client's own limit must not refuse any of it
    return lambda: open_client(system, config, threads, max_in_flight=UNBOUNDED)


def workload(cfg: DictConfig, **changes: Any) -> Workload:
    w = cfg.workload
    fields = {"words": w.words, "max_tokens": w.max_tokens, "temperature": w.temperature, "seed": cfg.seed,
              "spread": w.spread}
    return Workload(**{**fields, **changes})


async def warm_up(client: EngineClient, w: Workload, timeout_s: float = 600.0) -> None:
    """Two requests of each kind first, so one-off costs (first forward, lazy imports) are not measured."""
    import random

    rng = random.Random(0)
    reqs = [make_request(rng, kind, f"warm-{kind}-{i}", Workload(w.words, 4)) for kind in ("embed", "generate")
            for i in range(2)]
    calls = [(client.embed if r.kind == "embed" else client.generate)(r.input, r.params, r.request_id)
             for r in reqs]  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(asyncio.gather(*calls), timeout_s)
    except TimeoutError:
        raise RuntimeError(f"warm-up did not finish within {timeout_s:.0f} s") from None


def run_local(system: str, cfg: DictConfig, exp: ModuleType) -> dict[str, dict]:
    """`exp.run_system` on one system built in this interpreter; RunResults as dicts."""
    t0 = time.monotonic()
    session = Session(system, system_factory(system, cfg))
    try:
        logger.info("%s: ready in %.1f s", system, time.monotonic() - t0)
        session.run(warm_up(session.client, workload(cfg)))
        results: dict[str, RunResult] = exp.run_system(session, cfg)
    finally:
        session.shutdown()
    return {group: r.to_dict() for group, r in results.items()}


def peer_python(cfg: DictConfig, peer: str) -> str | None:
    """The interpreter a peer runs under: vLLM needs the peers venv; transformers and llama.cpp's client (its
    servers are their own processes) run anywhere."""
    if peer in ("hf", "llamacpp"):
        return sys.executable
    path = Path(cfg.peers_python)
    path = path if path.is_absolute() else ROOT / path
    return str(path) if path.exists() else None


def _peer_helpers() -> ModuleType:
    """scripts/peers/vllm_core_bench.py (stdlib only), whose `run_group` runs a peer's process tree."""
    sys.path.insert(0, str(ROOT / "scripts" / "peers"))
    import vllm_core_bench

    return vllm_core_bench


def run_peer(peer: str, cfg: DictConfig, experiment: str) -> dict[str, dict] | None:
    """`run_local` for a peer in a subprocess; None (logged) when its venv is missing or it fails."""
    python = peer_python(cfg, peer)
    if python is None:
        logger.warning("peer %s skipped: %s not found (install it with `make peers`)", peer, cfg.peers_python)
        return None
    with tempfile.TemporaryDirectory(prefix=f"bench_{peer}_") as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "results.json"
        cfg_path.write_text(json.dumps(OmegaConf.to_container(cfg, resolve=True)))
        cmd = [python, str(ROOT / "scripts" / "peer.py"), "experiment", "--peer", peer, "--experiment", experiment,
               "--config", str(cfg_path), "--out", str(out_path)]
        logger.info("peer %s: %s", peer, " ".join(cmd))
        run_group = _peer_helpers().run_group
        try:
            # NOTE: in its own process group, killed whole at the end: the peer's servers (vLLM's EngineCore and
            # workers) must not outlive it and hold cores through the next system's run
            returncode, _ = run_group(cmd, None, cfg.peer_timeout_s, capture=False, cwd=ROOT)
        except subprocess.TimeoutExpired:
            logger.error("peer %s timed out after %s s; its rows are missing", peer, cfg.peer_timeout_s)
            return None
        if returncode != 0 or not out_path.exists():
            logger.error("peer %s failed (exit code %s); its rows are missing", peer, returncode)
            return None
        return json.loads(out_path.read_text())


def first_peer(cfg: DictConfig, results: dict) -> str | None:
    """The first of `cfg.peers` with results: the second reference of the ratio columns."""
    return next((p for p in cfg.peers if p in results), None)


def run_experiment(cfg: DictConfig, exp: ModuleType, experiment: str) -> dict[str, dict[str, dict]]:
    """Every system in `cfg.systems`, then every peer in `cfg.peers`; `{system: {group: RunResult dict}}`."""
    results: dict[str, dict[str, dict]] = {}
    for system in cfg.systems:
        logger.info("== %s: %s", experiment, system)
        results[system] = run_local(system, cfg, exp)
    for peer in cfg.peers:
        logger.info("== %s: peer %s", experiment, peer)
        got = run_peer(peer, cfg, experiment)
        if got is not None:
            results[peer] = got
    return results
