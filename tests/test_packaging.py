"""A wheel installs everything under `orthrus_rag` (no bare `data` / `retrievers` / `pipelines` packages), with every
subpackage and the shipped embedding adapter, and the Hydra configs are found from a non-editable install."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
import pytest

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_is_namespaced_and_finds_its_configs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("orthrus_rag-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    _check_faiss_extras(zipfile.ZipFile(wheel))
    assert {n.split("/")[0] for n in names} == {"orthrus_rag", wheel.name.split("-")[0] + "-0.1.0.dist-info"}
    assert "orthrus_rag/data/__init__.py" in names and "orthrus_rag/conf/dataset/2wiki.yaml" in names
    assert {"orthrus_rag/structured/__init__.py", "orthrus_rag/entrypoints/ray/__init__.py",
            "orthrus_rag/adapters/smollm2_embed/adapter_model.safetensors",
            "orthrus_rag/adapters/smollm2_embed/orthrus_embedding.json"} <= set(names)  # model=smollm2_backbone's
    assert {"orthrus_rag/layers/csrc/kernels.cpp", "orthrus_rag/layers/csrc/lora.h"} <= set(names)  # the CPU kernels'
    assert not any(n.startswith("orthrus_rag/layers/csrc/") and n.endswith(".py") for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = ("import orthrus_rag; assert orthrus_rag.__file__.startswith(%r), orthrus_rag.__file__\n"
            "from orthrus_rag.layers import cpu_extension as ext\n"
            "assert ext.MAIN.is_file() and ext.MAIN.is_relative_to(%r), ext.MAIN\n"
            "assert {n for n, _ in ext._sources()} >= {'kernels.cpp', 'decode_attention.h', 'layer_loop.h'}\n"
            "from orthrus_rag.entrypoints.cli import main\n"
            "main(['run', '--cfg', 'job', 'dataset=hotpotqa', 'retriever=hnsw'])" % (str(target), str(target)))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "name: hotpotqa" in out.stdout and "index_type: hnsw" in out.stdout


def _check_faiss_extras(wheel: zipfile.ZipFile) -> None:
    """faiss-cpu and faiss-gpu-cu12 install the same `faiss` module, so no install may bring both: neither is a
    plain requirement, and each extra names exactly one (`pip install .[gpu]` used to bring faiss-cpu back)."""
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    requires = [line.split(":", 1)[1].strip() for line in wheel.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    faiss = [r for r in requires if r.lower().startswith("faiss")]
    assert all(";" in r for r in faiss), faiss  # only behind an extra
    by_extra = {extra: [r.split(";")[0].split(">")[0].strip() for r in faiss if f'extra == "{extra}"' in r]
                for extra in ("cpu", "gpu")}
    assert by_extra == {"cpu": ["faiss-cpu"], "gpu": ["faiss-gpu-cu12"]}, by_extra


def test_missing_faiss_is_a_config_error_naming_both_extras(monkeypatch):
    from orthrus_rag.entrypoints.cli_errors import EXIT_CONFIG, describe_error
    from orthrus_rag.retrievers.faiss_index import import_faiss

    monkeypatch.setitem(sys.modules, "faiss", None)  # an import of it now fails, as without the package
    try:
        import_faiss()
    except ImportError as exc:
        code, message = describe_error(exc)
    assert code == EXIT_CONFIG and "orthrus-rag[cpu]" in message and "orthrus-rag[gpu]" in message


def test_every_package_with_an_init_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "build" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), "subpackages missing from pyproject.toml's packages"
