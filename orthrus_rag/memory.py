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


def bound_shape_caches() -> dict[str, str]:
    """Turn down oneDNN's per-shape caches for this process and the workers it starts, unless the user set them.
    Both are read when oneDNN first runs, so call this before any model runs a step; returns the values in force."""
    for name, value in SHAPE_CACHE_ENV.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in SHAPE_CACHE_ENV}
