"""The one home of configuration:

- kernels.py: the parts of a step and each one's implementations (`model.kernels`, `model.kernel_overrides`);
- engine.py: the engine's dataclasses (`EngineConfig` = `ModelConfig` + `CacheConfig` + `SchedulerConfig`), which
  are also the CLI's `model`, `cache` and `scheduler` nodes;
- app.py: the CLI's other nodes (`dataset`, `deploy`, `retriever`, `pipeline`, `serve`) and `AppConf`, registered
  as Hydra's structured config;
- build.py: the one mapping into an `EngineConfig`, from option names (`engine_config`) or from the config's
  nodes (`engine_config_from`);
- saved.py: a run folder's saved config against today's (resume; the old keys of old folders).

A composed config is validated by the entry points (`orthrus_rag.entrypoints.checks.validate`), which ask each
rule of its owner, above this package.
"""

from orthrus_rag.config.engine import (ADAPTER_KINDS, CacheConfig, EngineConfig, ModelConfig,
                                       SchedulerConfig, SloConfig)

__all__ = ["ADAPTER_KINDS", "CacheConfig", "EngineConfig", "ModelConfig", "SchedulerConfig",
           "SloConfig"]
