"""The CPU kernels' build: a lock file left by a killed build is cleared; a fresh one (a build running in another
process right now, or one killed a moment ago) is waited on, with a warning naming it, until it goes away or is
older than $ORTHRUS_BUILD_LOCK_TIMEOUT_S, when it is removed as stale (torch's own wait never ends)."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from torch.utils import cpp_extension

from orthrus_rag.layers import cpu_extension

NAME = "orthrus_test_build"


def _lock(tmp_path, monkeypatch, age_s: float):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpp_extension._get_build_directory(NAME, False)
    os.makedirs(folder, exist_ok=True)
    lock = os.path.join(folder, "lock")
    open(lock, "w").close()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


@pytest.fixture
def quick(monkeypatch):
    """Polls and reports every 50 ms, so that waits in these tests take a fraction of a second."""
    monkeypatch.setattr(cpu_extension, "LOCK_POLL_S", 0.05)
    monkeypatch.setattr(cpu_extension, "LOCK_REPORT_EVERY_S", 0.2)


def test_a_stale_lock_is_removed(tmp_path, monkeypatch, caplog):
    lock = _lock(tmp_path, monkeypatch, age_s=cpu_extension.STALE_LOCK_S + 60)
    assert cpu_extension.clear_stale_lock(cpp_extension, NAME)
    assert not os.path.exists(lock) and "stale build lock" in caplog.text


def test_a_fresh_lock_is_left_to_its_build(tmp_path, monkeypatch):
    lock = _lock(tmp_path, monkeypatch, age_s=5)
    assert not cpu_extension.clear_stale_lock(cpp_extension, NAME)
    assert os.path.exists(lock)


def test_no_lock_is_nothing_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not cpu_extension.clear_stale_lock(cpp_extension, "orthrus_none")


def test_a_young_lock_is_waited_on_then_removed_as_stale(tmp_path, monkeypatch, caplog, quick):
    lock = _lock(tmp_path, monkeypatch, age_s=0)
    monkeypatch.setenv(cpu_extension.LOCK_TIMEOUT_ENV, "0.7")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        assert cpu_extension.wait_for_build_lock(cpp_extension, NAME)
    waited = time.monotonic() - start
    assert not os.path.exists(lock)
    assert 0.6 < waited < 2.0, waited  # until the lock was 0.7 s old, not at once and not for long after
    waits = [r.getMessage() for r in caplog.records if "another process may be building" in r.getMessage()]
    assert waits and all(lock in m and cpu_extension.LOCK_TIMEOUT_ENV in m for m in waits)
    assert len(waits) >= 2  # reported at the start and again while the wait went on (every 0.2 s here)
    assert f"removing a stale build lock {lock}" in caplog.text


def test_a_lock_that_goes_away_ends_the_wait_at_once(tmp_path, monkeypatch, quick):
    lock = _lock(tmp_path, monkeypatch, age_s=0)
    monkeypatch.setenv(cpu_extension.LOCK_TIMEOUT_ENV, "30")
    remover = threading.Timer(0.3, os.remove, (lock,))  # the other process's build finishes
    remover.start()
    start = time.monotonic()
    try:
        assert not cpu_extension.wait_for_build_lock(cpp_extension, NAME)
    finally:
        remover.join()
    assert time.monotonic() - start < 1.5


def test_no_lock_returns_at_once_and_says_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    start = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger=cpu_extension.__name__):
        assert not cpu_extension.wait_for_build_lock(cpp_extension, "orthrus_none")
    assert time.monotonic() - start < 0.1 and not caplog.records


def test_the_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(cpu_extension.LOCK_TIMEOUT_ENV, raising=False)
    assert cpu_extension.lock_timeout_s() == cpu_extension.STALE_LOCK_S
    monkeypatch.setenv(cpu_extension.LOCK_TIMEOUT_ENV, "42.5")
    assert cpu_extension.lock_timeout_s() == 42.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(cpu_extension.LOCK_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=cpu_extension.LOCK_TIMEOUT_ENV):
            cpu_extension.lock_timeout_s()


def test_the_loader_runs_only_after_a_young_lock_is_cleared(tmp_path, monkeypatch, quick):
    """`kernels()` itself waits before calling torch's loader (which would spin on the lock with no message)."""
    lock = _lock(tmp_path, monkeypatch, age_s=0)
    monkeypatch.setenv(cpu_extension.LOCK_TIMEOUT_ENV, "0.3")
    monkeypatch.setattr(cpu_extension, "build_name", lambda: NAME)
    seen: list[bool] = []

    def load(**kwargs):
        seen.append(os.path.exists(lock))
        return "built"

    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu_extension.kernels.__wrapped__() == "built"  # NOTE: past the lru_cache, which holds the real build
    assert seen == [False]


def test_the_build_is_named_by_every_source_files_text(tmp_path, monkeypatch):
    """torch's loader checks kernels.cpp alone, not the headers it includes: an edited header must build anew."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(cpu_extension.CSRC, copy)
    monkeypatch.setattr(cpu_extension, "CSRC", copy)
    before = cpu_extension.build_name()
    lora = copy / "lora.h"
    lora.write_text(lora.read_text() + "\n// edited\n")
    assert cpu_extension.build_name() != before


def test_no_cpp_source_is_kept_inside_a_python_file():
    """The kernels' C++ lives in layers/csrc/*.h / *.cpp, where editors, linters and the compiler see it."""
    package = cpu_extension.CSRC.parents[1]
    offenders = [str(f) for f in package.rglob("*.py") if "#include <torch/extension.h>" in f.read_text()]
    assert not offenders
