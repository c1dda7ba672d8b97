"""The engine's C++ CPU kernels, built as one torch extension on first use per machine.

Its C++ sources are the files of layers/csrc/, shipped as package data: one header per kernel family, each
described by the module that calls it: decode attention over the paged cache (attention/cpu_kernels.py),
chunked-prefill attention in AVX512-BF16 or on AMX tiles (attention/cpu_prefill.py), the fused elementwise ops of a decoder layer:
residual add + RMSNorm, rotary, SiLU-and-mul (cpu_elementwise.py), the sampler's draw from each row's
probabilities and its greedy argmax (sampler.py), adapter rows' LoRA updates (lora_fused.py), and the decoder's
layer loop, which calls the others (cpu_layer_loop.py); kernels.cpp includes them all as one translation unit
and binds the functions Python calls. One build, not six: each costs ~30-60 s of compiling on a fresh machine.

The build is compiled with `-march=native` into torch's extension cache under a name that carries the CPU model,
the torch version, the flags and every source file's text (`machine_key`; torch's own check sees kernels.cpp
only, not the headers it includes), so another CPU or an edited kernel builds anew.
`ORTHRUS_CPU_ISA=avx2` builds it for x86-64-v3 instead, under its own name (machine.py): the paths an AVX2-only
CPU runs, tested on any x86-64 one. It needs a
C++ compiler and ninja; where the build fails every caller keeps its pure-torch path (SDPA, eager ops).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from orthrus_rag.machine import machine_key, march

logger = logging.getLogger(__name__)

# a build takes ~30-60 s; a lock file older than this was left by a build that was killed (torch's loader would
# wait on it forever: its lock is a bare O_EXCL file that names no owner)
STALE_LOCK_S = 600.0
# how long to wait on a lock another process holds before treating it as stale (default STALE_LOCK_S)
LOCK_TIMEOUT_ENV = "ORTHRUS_BUILD_LOCK_TIMEOUT_S"
LOCK_POLL_S = 0.5
LOCK_REPORT_EVERY_S = 15.0
_LOCK = threading.Lock()
# NOTE: -mno-recip: under -ffast-math GCC turns vector float divisions into a reciprocal estimate and one
# Newton step, exact enough from AVX-512's 14-bit estimate but not from AVX2's 12-bit one (silu(100) came out
# 99.99999 there); a true division costs a little more in SiLU-and-mul alone and is the same bits on every ISA
CFLAGS = ["-O3", "-fopenmp", "-ffast-math", "-mno-recip"]


CSRC = Path(__file__).parent / "csrc"
MAIN = CSRC / "kernels.cpp"


def _sources() -> list[tuple[str, str]]:
    """(name, text) of every C++ file of the extension, in a fixed order."""
    return [(f.name, f.read_text()) for f in sorted(CSRC.iterdir()) if f.suffix in (".h", ".cpp")]


def build_name() -> str:
    """One build per CPU model, torch version, flags and sources: `-march=native` code must not run on another CPU."""
    return f"orthrus_cpu_kernels_{machine_key(*_sources(), *CFLAGS)}"


@lru_cache(maxsize=1)
def kernels() -> Any:
    """The compiled extension, or None where it cannot be built."""
    from torch.utils import cpp_extension

    with _LOCK:
        try:
            name = build_name()
            # NOTE: torch's own wait on the lock is silent and endless: wait here first, bounded and logged
            wait_for_build_lock(cpp_extension, name)
            # NOTE: torch's loader reuses a build it finds; only the first use on a machine compiles
            logger.info("loading the CPU kernels (compiled on first use per machine: ~30-60 s)")
            return cpp_extension.load(
                name=name, sources=[str(MAIN)], extra_include_paths=[str(CSRC)],
                extra_cflags=CFLAGS + [f"-march={march()}"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # NOTE: no compiler, no ninja, an unusual platform: the torch paths still work
            logger.warning("CPU kernels unavailable (%s: %s); using torch's ops", type(exc).__name__, exc)
            return None


def lock_timeout_s() -> float:
    """Seconds a build lock may be held before it counts as stale: $ORTHRUS_BUILD_LOCK_TIMEOUT_S or STALE_LOCK_S."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return STALE_LOCK_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NOTE: also refuses nan
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={raw!r}: expected a number of seconds >= 0, e.g. {STALE_LOCK_S:.0f}")
    return value


def wait_for_build_lock(cpp_extension: Any, name: str, timeout_s: float | None = None) -> bool:
    """Wait while the build folder's lock exists, at most until it is `timeout_s` old (default `lock_timeout_s()`),
    then remove it as stale; True if one was removed. Logs the wait at its start and every LOCK_REPORT_EVERY_S."""
    timeout_s = lock_timeout_s() if timeout_s is None else timeout_s
    lock = _lock_path(cpp_extension, name)
    reported_at: float | None = None
    while (age := _lock_age(lock)) is not None:
        if age > timeout_s:
            return clear_stale_lock(cpp_extension, name, timeout_s)
        now = time.monotonic()
        if reported_at is None or now - reported_at >= LOCK_REPORT_EVERY_S:
            reported_at = now
            logger.warning("the CPU kernels' build lock %s has been held for %.0f s: another process may be "
                           "building them; waiting (at %.0f s old it is treated as stale and removed: %s)",
                           lock, age, timeout_s, LOCK_TIMEOUT_ENV)
        time.sleep(max(0.0, min(LOCK_POLL_S, timeout_s - age)) + 0.01)
    return False  # no lock, or its build ended: torch's loader finds what that build left


def clear_stale_lock(cpp_extension: Any, name: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build folder's lock file if it is older than `max_age_s`; True if one was removed."""
    lock = _lock_path(cpp_extension, name)
    age = _lock_age(lock)
    if age is None or age <= max_age_s:
        return False  # another process may be building right now: wait for it (wait_for_build_lock)
    logger.warning("removing a stale build lock %s (%.0f s old: a killed build left it)", lock, age)
    try:
        os.remove(lock)
    except FileNotFoundError:  # NOTE: another process removed it first
        pass
    return True


def _lock_path(cpp_extension: Any, name: str) -> str:
    folder = cpp_extension._get_build_directory(name, False)  # NOTE: private, but the one place torch puts it
    return os.path.join(folder, "lock")


def _lock_age(lock: str) -> float | None:
    """Seconds since the lock was made (torch's baton never touches it again), or None if there is none."""
    try:
        return time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return None
