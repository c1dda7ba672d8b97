"""The one place that turns engine options by name (`max_num_batched_tokens=128`, `policy="hetero-fcfs"`, ...) into
an `EngineConfig`. `Engine.from_pretrained`, the scripts and the benchmark harness build their config here, so a
new engine setting needs no edit anywhere else (the CLI and the server need none either: their config nodes are
the dataclasses themselves, app_config.engine_config_from).

The policy name is checked by the policy registry (engine/policies.py), the one owner of policy names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from orthrus_rag.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from orthrus_rag.engine.core.policies import check_policy

_PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}


def engine_config(model: str = "smollm2-135m-instruct", embedding_adapters: str | Sequence[str] | None = None,
                  embedding_model: str | None = None, **options: Any) -> EngineConfig:
    """An `EngineConfig` from a model and options named like the fields of its sub-configs; an unknown name or
    policy is a ValueError before any weights load."""
    adapters = [embedding_adapters] if isinstance(embedding_adapters, str) else list(embedding_adapters or [])
    parts: dict[str, Any] = {"model": ModelConfig(name=model, embedding_adapters=adapters,
                                                  embedding_model=embedding_model),
                             "cache": CacheConfig(), "scheduler": SchedulerConfig()}
    top: dict[str, Any] = {}
    for key, value in options.items():
        target = next((name for name, obj in parts.items() if key in {f.name for f in fields(obj)}), None)
        if target is not None:
            parts[target] = replace(parts[target], **{key: value})
        elif key in EngineConfig.__dataclass_fields__ and key not in _PARTS:
            top[key] = value
        else:
            raise ValueError(f"unknown engine option {key!r}")
    config = EngineConfig(**parts, **top)
    check_policy(config.scheduler.policy)
    return config


def parse_option(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` from a command line (the scripts' `--option`): the value as JSON where it parses (numbers,
    true / false / null in any case, lists), else the string itself (`attention_backend=grouped`)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"an engine option needs NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value.lower() if value.lower() in ("true", "false", "null") else value)
    except json.JSONDecodeError:
        return name, value
