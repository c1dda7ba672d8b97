"""What this machine is, for per-machine caches: a kernel built with `-march=native`, a GEMM kernel chosen by
timing. Either must be redone on another CPU, and must not change between runs on the same one (a run resumed
in a new process must compute exactly what it computed before)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
        if line:
            return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[1].split()) if line else set()


def has_native_bf16() -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX): where bf16 GEMMs run 3-4x fp32's (measured on an EPYC
    core, SmolLM2's shapes at 8-256 rows), so "auto" picks bf16 there."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def machine_key(*parts: object) -> str:
    """A short digest of the CPU model, the torch version and `parts`."""
    return hashlib.sha256(repr((cpu_model(), torch.__version__, *parts)).encode()).hexdigest()[:16]


def remembered(path: Path, key: str, compute: Callable[[], str]) -> str:
    """`compute()` once per key, kept in the JSON file `path` (written atomically; unreadable files are redone)."""
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    known[key] = value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except OSError as exc:  # NOTE: a read-only home still runs, it just measures again next time
        logger.warning("could not remember %s in %s: %s", key, path, exc)
    return value
