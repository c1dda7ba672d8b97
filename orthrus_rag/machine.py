"""What this machine is, for per-machine caches: a kernel built with `-march=native`, a GEMM kernel chosen by
timing. Either must be redone on another CPU, and must not change between runs on the same one (a run resumed
in a new process must compute exactly what it computed before).

`ORTHRUS_CPU_ISA=avx2` makes this machine read as an AVX2-only x86-64 CPU (x86-64-v3: AVX2 and FMA, no AVX-512,
no AMX): its flags lose every AVX-512 and AMX one, so `dtype="auto"` is fp32; oneDNN's packed bf16 path counts as
unsupported (what torch reports on such a CPU), so bf16 linears stay dense; and the C++ kernels build with
`-march=x86-64-v3` under their own name, so their AVX2 / generic paths run. `make test` runs the kernel tests a
second time under it, so those paths are tested on every machine, not only on AVX2 ones."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ISA_ENV = "ORTHRUS_CPU_ISA"
# the -march each ISA builds the C++ kernels for ("native": whatever this CPU has)
ISA_MARCH = {"native": "native", "avx2": "x86-64-v3"}
# flags an AVX2-only CPU does not report: every AVX-512 and AMX extension, and the AVX ones newer than x86-64-v3
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")


def isa() -> str:
    """The instruction set the engine targets: "native" unless ORTHRUS_CPU_ISA names another (see the module)."""
    value = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if value not in ISA_MARCH:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISA_MARCH)}")
    return value


def march() -> str:
    """The compiler's -march for the C++ kernels."""
    return ISA_MARCH[isa()]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
        if line:
            return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def _proc_flags() -> frozenset[str]:
    # NOTE: read once: the CPU does not change under a process, and callers ask per step (cpu_prefill's AMX check)
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split()) if line else frozenset()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where it cannot be read), less those above the ISA the engine
    targets (`isa()`)."""
    flags = _proc_flags()
    if isa() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_ABOVE_AVX2))
    return flags


def has_native_bf16() -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX): where bf16 GEMMs run 3-4x fp32's (measured on an EPYC
    core, SmolLM2's shapes at 8-256 rows), so "auto" picks bf16 there."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


# what torch's oneDNN bf16 path needs (aten's mkldnn_bf16_device_check): without it the weight reorder raises
ONEDNN_BF16_FLAGS = "avx512bw, avx512vl and avx512dq, or avx_ne_convert"


def onednn_bf16_supported() -> bool:
    """Whether torch's oneDNN runs bf16 here (packed bf16 linears): False on AVX2-only CPUs, where torch's
    `mkldnn_reorder_linear_weight` raises, and under ORTHRUS_CPU_ISA=avx2."""
    if isa() == "avx2" or not torch.backends.mkldnn.is_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is None:  # NOTE: a torch without the query: the flags it checks
        flags = cpu_flags()
        return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    return bool(check())


def machine_key(*parts: object) -> str:
    """A short digest of the CPU model, the targeted ISA, the torch version and `parts`."""
    return hashlib.sha256(repr((cpu_model(), isa(), torch.__version__, *parts)).encode()).hexdigest()[:16]


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


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (`omp_pause_resource_all(omp_pause_hard)` of the OpenMP runtime
    torch runs on); False where that runtime or the call is missing. Its next parallel op builds a new one.

    Why: GNU OpenMP keeps one pool per thread that ever ran a parallel op, and once the pools' threads outnumber
    the CPUs it switches every pool to a short spin (100 rounds) before sleeping, so each of a step's many small
    parallel ops waits on a futex wake-up. An engine loaded on one thread (its pool stays, idle) and stepped on
    another (the asyncio engine's) ran 15-20% slower on 2 cores for that alone (docs/design/engine-step.md)."""
    import ctypes
    import glob

    paths = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*omp*.so*")))
    for path in [*paths, None]:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause(2) == 0  # NOTE: 2 is omp_pause_hard: the pool's threads exit
    return False
