"""The one mapping into an `EngineConfig`: from engine options by name (`max_num_batched_tokens=128`,
`policy="hetero-fcfs"`: `Engine.from_pretrained` and the scripts' `--option NAME=VALUE`) or from a config's `model`,
`cache` and `scheduler` nodes (the CLI's, a benchmark's bench.yaml). Either way each part's own `__post_init__` checks
it (the policy name: the policy registry, when an engine is built or a config validated), so a new engine setting
needs no edit here or anywhere else."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any, TypeVar

from orthrus_rag.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}  # EngineConfig's, by node name
T = TypeVar("T")
_NAMES_ITS_SETTING = re.compile(r"[a-z][a-z0-9_]* must ")  # "k must be at least 1", not "k, nlist must ..."


def engine_config(model: str = "smollm2-135m-instruct", embedding_adapters: str | Sequence[str] | None = None,
                  embedding_model: str | None = None, **options: Any) -> EngineConfig:
    """An `EngineConfig` from a model and options named like the fields of its parts; an unknown name or policy is
    a ValueError before any weights load."""
    adapters = [embedding_adapters] if isinstance(embedding_adapters, str) else list(embedding_adapters or [])
    parts: dict[str, Any] = {"model": ModelConfig(name=model, embedding_adapters=adapters,
                                                  embedding_model=embedding_model),
                             "cache": CacheConfig(), "scheduler": SchedulerConfig()}
    top: dict[str, Any] = {}
    changes: dict[str, dict[str, Any]] = {name: {} for name in parts}
    for key, value in options.items():
        target = next((name for name, obj in parts.items() if key in {f.name for f in fields(obj)}), None)
        if target is not None:
            changes[target][key] = value
        elif key in EngineConfig.__dataclass_fields__ and key not in PARTS:
            top[key] = value
        else:
            raise ValueError(f"unknown engine option {key!r}")
    # NOTE: a part's options replace together, so rules across them (a reranker naming an adapter) see them all
    parts = {name: replace(obj, **changes[name]) if changes[name] else obj for name, obj in parts.items()}
    return _assembled(parts, **top)


def engine_config_from(cfg: Any) -> EngineConfig:
    """A config's `model`, `cache` and `scheduler` nodes (a part it lacks takes its defaults) as the engine's
    config, with `deploy.num_threads` and `seed` where it has them; a bad value fails named by its node
    (`scheduler: ...`). Loads nothing: the one engine's config, or each worker's of a deployment."""
    from omegaconf import DictConfig, OmegaConf

    def values(key: str) -> dict[str, Any]:
        node = cfg.get(key)
        return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})

    parts = {key: owned(key, lambda key=key, part=part: part(**values(key))) for key, part in PARTS.items()}
    deploy = cfg.get("deploy")
    return _assembled(parts, num_threads=deploy.num_threads if deploy is not None else None, seed=cfg.get("seed", 0))


def _assembled(parts: dict[str, Any], **top: Any) -> EngineConfig:
    # NOTE: the policy name is the policy registry's to check (engine/core/policies.py): `Engine.from_config` asks
    # it before any weights load, and so does the CLI's `validate`; this package imports nothing of the engine
    return EngineConfig(**parts, **top)


def owned(prefix: str, build: Callable[[], T], keyed: bool = False) -> T:
    """`build()`; a ValueError from the type that owns the rule comes out named by its key group (`model: unknown
    dtype ...`), or with `keyed` by the key itself where the owner's message starts with the setting's name
    (`retriever.k must be at least 1`: the owner names its argument, the config key is group.argument)."""
    try:
        return build()
    except ValueError as exc:
        message = str(exc)
        sep = "." if keyed and _NAMES_ITS_SETTING.match(message) else ": "
        raise ValueError(f"{prefix}{sep}{message}") from None


def parse_option(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` from a command line (the scripts' `--option`): the value as JSON where it parses (numbers,
    true / false / null in any case, lists, objects: `kernel_overrides={"layers": "fused"}`), else the string itself
    (`kernels=torch`)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"an engine option needs NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value.lower() if value.lower() in ("true", "false", "null") else value)
    except json.JSONDecodeError:
        return name, value
