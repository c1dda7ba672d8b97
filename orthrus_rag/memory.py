"""Give the C heap's free memory back to the operating system between long phases of work.

glibc keeps what a freed tensor's buffer used inside its heaps for reuse; a loop whose step tensors change size every
step (an index build: each step's token count differs) leaves hundreds of MB of free but resident memory behind it,
which the next phase then adds to (measured: docs/benchmarks/corpus-embedding.md). `malloc_trim(0)` returns the free
pages at once; elsewhere (musl, macOS, Windows) this is a no-op.

A second owner of such memory is oneDNN, which PyTorch's CPU matmuls run on: it caches one compiled primitive
(code and scratchpad) per input shape, in its own primitive cache and in PyTorch's ideep LRU (1,024 entries
each), and a build's steps almost never repeat a shape. `bound_shape_caches` turns both down for a process whose
shapes never repeat (pytorch/pytorch#27971, #32037).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from functools import cache

logger = logging.getLogger(__name__)


@cache
def _trim():  # noqa: ANN202 (a ctypes function, or None)
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # NOTE: a C library without malloc_trim (not glibc)
        return None


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS; True where the C library can (glibc)."""
    trim = _trim()
    if trim is None:
        return False
    trim(0)
    return True


# NOTE: measured by building 1,024-passage shards with MiniLM (bf16 and fp32) and reading resident memory: resident
# memory after each shard's trim grew ~16 MB a shard with both caches at their defaults, ~8 MB with oneDNN's
# alone at 0, and not at all with both off, at the same passages/s (a 4,096-token step's GEMMs dwarf building
# their primitives); docs/benchmarks/corpus-embedding.md
SHAPE_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "1"}
# A server's steps do repeat shapes (decode-only steps of the same batch, whole-budget chunks), and building a
# primitive costs more than a small step's GEMM: with both caches off a 5:5 load on two Xeon cores ran at 0.31x its
# requests/s. At 1,024 entries each (the defaults) the same load left the server at 2,386 MiB resident, at 128 at
# 2,051-2,095 MiB with the same requests/s; at 1:9 2,424 against 2,066 MiB at 0.93-0.96x (within that mix's
# run-to-run spread); at 9:1 about the same either way (docs/benchmarks/ratio-sweep.md).
SERVING_SHAPE_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "128"}


def bound_shape_caches(values: dict[str, str] = SHAPE_CACHE_ENV) -> dict[str, str]:
    """Turn down oneDNN's per-shape caches (off by default: a process whose shapes never repeat; SERVING_SHAPE_CACHE_ENV
    for a server) for this process and the workers it starts, unless the user set them. Both are read when oneDNN
    first runs, so call this before any model runs a step; returns the values in force."""
    for name, value in values.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in values}
