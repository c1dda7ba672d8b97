"""Handing the C heap's free pages back: it runs on glibc, and frees resident memory a freed buffer held."""

from __future__ import annotations

import ctypes.util
import platform

import psutil
import pytest

from orthrus_rag.memory import SHAPE_CACHE_ENV, bound_shape_caches, release_free_memory


@pytest.mark.skipif(platform.system() != "Linux" or "musl" in (ctypes.util.find_library("c") or ""),
                    reason="malloc_trim is glibc's")
def test_freed_heap_memory_goes_back_to_the_os() -> None:
    import gc

    # many medium blocks, below glibc's mmap threshold, so they live in the heap; a last one keeps its top busy
    blocks = [bytearray(64 * 1024) for _ in range(4000)]  # ~256 MB
    keep = bytearray(64 * 1024)
    del blocks
    gc.collect()
    before = psutil.Process().memory_info().rss
    assert release_free_memory() is True
    after = psutil.Process().memory_info().rss
    assert before - after > 100 * 2**20, (before, after)
    assert keep  # still alive: only free pages were returned


def test_oneDNN_shape_caches_are_turned_down_unless_the_user_set_them(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")  # the user's own value stays
    assert bound_shape_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "64"}
    assert set(SHAPE_CACHE_ENV) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"}
