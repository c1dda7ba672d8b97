"""A wheel installs everything under `orthrus_rag` (no bare `data` / `retrievers` / `pipelines` packages), and the
Hydra configs are found from a non-editable install."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_is_namespaced_and_finds_its_configs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("orthrus_rag-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"orthrus_rag", wheel.name.split("-")[0] + "-0.1.0.dist-info"}
    assert "orthrus_rag/data/__init__.py" in names and "orthrus_rag/conf/dataset/2wiki.yaml" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = ("import orthrus_rag; assert orthrus_rag.__file__.startswith(%r), orthrus_rag.__file__\n"
            "from orthrus_rag.cli import main\n"
            "main(['run', '--cfg', 'job', 'dataset=hotpotqa', 'retriever=hnsw'])" % str(target))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "name: hotpotqa" in out.stdout and "index_type: hnsw" in out.stdout
