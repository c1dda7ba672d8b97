"""A run folder's saved config against today's: what `resume=` compares, restores and allows to change. The old keys
of folders written before the engine's dataclasses became the config nodes live here only."""

from __future__ import annotations

from typing import Any

from orthrus_rag.config.app import OPERATIONAL_KEYS, AppConf


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _plain(cfg: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


# a run folder's config.yaml from before the engine's dataclasses became the config nodes names its
# settings by these keys; the old names are frozen, so the table is written out rather than derived
OLD_KEYS = {
    "engine.serving": "deploy.mode", "engine.threads": "deploy.threads",
    "engine.max_in_flight": "deploy.max_in_flight", "engine.max_pending": "deploy.max_in_flight",
    "model.num_threads": "deploy.num_threads", "model.embedding_adapter": "model.embedding_adapters",
    **{f"engine.{k}": f"scheduler.{k}" for k in (
        "policy", "max_num_batched_tokens", "max_num_seqs", "max_chunk_tokens", "min_share", "cost_budget",
        "step_time_target", "step_time_margin")},
    **{f"engine.{k}": f"cache.{k}" for k in ("block_size", "kv_cache_gib", "enable_prefix_caching")},
}


# the implementation switches of folders written before `model.kernels` / `model.kernel_overrides`: (part, the
# override a value asks for); a value that asks for the default (true, "auto") becomes no override
OLD_KERNEL_SWITCHES = {
    "cpu_decode_kernel": ("decode_attention", {False: "sdpa"}), "cpu_prefill_kernel": ("prefill_attention",
                                                                                     {False: "sdpa"}),
    "cpu_fused_kernels": ("layers", {False: "torch"}), "cpu_layer_loop": ("layers", {False: "fused"}),
    "cpu_layer_split": ("layers", {False: "loop"}), "cpu_sample_kernel": ("sampler", {False: "torch"}),
    "cuda_graphs": ("cuda_graphs", {False: "off"}), "compile_elementwise": ("layers", {False: "torch"}),
    "linear_kernel": ("linears", {"dense": "dense", "onednn": "onednn"}),
    "lora_kernel": ("lora", {"per_slot": "per_slot", "stacked": "stacked"}),
    "attention_backend": ("attention", {"grouped": "grouped", "varlen": "varlen"}),
}


def _upgrade_kernel_switches(model: dict[str, Any]) -> None:
    overrides = dict(model.get("kernel_overrides") or {})
    for key, (part, asks) in OLD_KERNEL_SWITCHES.items():
        if key in model and (choice := asks.get(model.pop(key))) is not None:
            overrides.setdefault(part, choice)  # NOTE: the first switch that turned a part off names its choice
    if overrides:
        model["kernel_overrides"] = overrides


def upgrade_saved(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config (plain nested dicts) with its old keys (OLD_KEYS, OLD_KERNEL_SWITCHES) renamed; a config
    already in today's keys comes back unchanged."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    if isinstance(out.get("model"), dict):
        _upgrade_kernel_switches(out["model"])
    for old, new in OLD_KEYS.items():
        group, key = old.split(".")
        if key not in out.get(group, {}):
            continue
        value = out[group].pop(key)
        if new == "model.embedding_adapters":  # one optional folder then, a list of folders now
            value = [] if value is None else [value]
        new_group, new_key = new.split(".")
        out.setdefault(new_group, {})[new_key] = value
    if out.get("engine") == {}:
        del out["engine"]
    return out


def saved_config(saved: Any) -> Any:  # -> DictConfig
    """A run folder's saved config (config.yaml's text, or that loaded) in today's schema: old keys renamed, and
    settings it predates at their defaults, which that run used."""
    from omegaconf import OmegaConf

    plain = _plain(OmegaConf.create(saved) if isinstance(saved, str) else saved)
    return OmegaConf.merge(OmegaConf.structured(AppConf), upgrade_saved(plain))


def config_diff(saved: Any, current: Any) -> list[str]:
    """`key: saved -> current` for every setting that differs, the operational ones aside."""
    old, new = _flatten(_plain(saved_config(saved))), _flatten(_plain(current))
    keys = sorted((set(old) | set(new)) - set(OPERATIONAL_KEYS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def resumed_config(saved_yaml: str, current: Any, overridden: set[str], any_key: bool = False) -> Any:
    """The config a run was started with (its saved config.yaml), with `run_dir`, `resume` and the operational
    settings in `overridden` (those given on the command line) taken from `current`; with `any_key`, every
    setting in `overridden` (an index folder resumed as another index: its build checks what must not change)."""
    from omegaconf import OmegaConf

    cfg = saved_config(saved_yaml)
    for key in {"run_dir", "resume"} | (overridden if any_key else set(OPERATIONAL_KEYS) & overridden):
        OmegaConf.update(cfg, key, OmegaConf.select(current, key), merge=False)
    return cfg
