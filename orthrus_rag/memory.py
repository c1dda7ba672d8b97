"""Give the C heap's free memory back to the operating system between long phases of work.

glibc keeps what a freed tensor's buffer used inside its heaps for reuse; a loop whose step tensors change size
every step (an index build: each step's token count differs) leaves hundreds of MB of free but resident memory
behind it, which the next phase then adds to (measured: BENCHMARKS.md, session 17). `malloc_trim(0)` returns the
free pages at once; elsewhere (musl, macOS, Windows) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
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
