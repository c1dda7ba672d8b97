"""Model names, folders and GGUF files resolve to checkpoint folders; user GGUF conversions never collide."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orthrus_rag.models import registry


@pytest.fixture
def converted(monkeypatch, tmp_path):
    """Record the conversions asked for instead of running them."""
    calls: list[tuple[Path, Path]] = []
    monkeypatch.setenv("ORTHRUS_RAG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "convert_gguf", lambda src, out: calls.append((src, out)) or out)
    return calls


@pytest.mark.slow
def test_gguf_files_of_one_name_get_their_own_conversion(converted, tmp_path):
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, data in ((a, b"one"), (b, b"other")):
        path.parent.mkdir()
        path.write_bytes(data)
    out_a, out_b = registry.resolve_model_path(str(a)), registry.resolve_model_path(str(b))
    assert out_a != out_b and out_a.parent == out_b.parent == tmp_path / "cache"
    assert out_a.name.startswith("model-") and registry.resolve_model_path(str(a)) == out_a  # stable
    a.write_bytes(b"replaced in place")
    os.utime(a, ns=(1, 1))
    assert registry.resolve_model_path(str(a)) != out_a  # a new file is converted anew


@pytest.mark.slow
def test_bad_names_say_what_is_accepted(converted, tmp_path):
    with pytest.raises(ValueError, match="GGUF file not found"):
        registry.resolve_model_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="neither a built-in name"):
        registry.resolve_model_path("./no/such/folder")
    assert registry.resolve_model_path(str(tmp_path)) == tmp_path  # a folder is used as it is
    assert converted == []
