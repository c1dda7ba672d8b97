"""The CPU kernels' build: a lock file left by a killed build is cleared, a fresh one (a build running in
another process right now) is waited on as torch does."""

from __future__ import annotations

import os
import time

from torch.utils import cpp_extension

from orthrus_rag.layers import cpu_extension


def _lock(tmp_path, monkeypatch, age_s: float):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpp_extension._get_build_directory("orthrus_test_build", False)
    os.makedirs(folder, exist_ok=True)
    lock = os.path.join(folder, "lock")
    open(lock, "w").close()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_stale_lock_is_removed(tmp_path, monkeypatch, caplog):
    lock = _lock(tmp_path, monkeypatch, age_s=cpu_extension.STALE_LOCK_S + 60)
    assert cpu_extension.clear_stale_lock(cpp_extension, "orthrus_test_build")
    assert not os.path.exists(lock) and "stale build lock" in caplog.text


def test_a_fresh_lock_is_left_to_its_build(tmp_path, monkeypatch):
    lock = _lock(tmp_path, monkeypatch, age_s=5)
    assert not cpu_extension.clear_stale_lock(cpp_extension, "orthrus_test_build")
    assert os.path.exists(lock)


def test_no_lock_is_nothing_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not cpu_extension.clear_stale_lock(cpp_extension, "orthrus_none")
