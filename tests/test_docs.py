"""The documentation: the site builds strictly, the configuration reference covers every key, every committed
benchmark result redraws its plots, README stays a landing page, and what a user reads speaks of the product."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "benchmarks" / "img"
# what a user reads never tells how the project was built (history goes to CHANGELOG.md and commit messages)
PROCESS_WORDS = re.compile(r"sessions? [0-9]|issues? [0-9]|must.show|\.\./shared", re.IGNORECASE)
USER_FACING = ["README.md", "CHANGELOG.md", "docs", "orthrus_rag", "retrievers", "pipelines", "data", "scripts", "conf",
               "examples", "mkdocs.yml", "Makefile", "pyproject.toml"]
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".h", ".cpp", ".toml", ".json", ".jsonl", ".txt", ""}


def _user_files() -> list[Path]:
    out: list[Path] = []
    for name in USER_FACING:
        path = ROOT / name
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        out += [p for p in files if p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return out


def test_nothing_a_user_reads_speaks_of_the_work_process():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in _user_files()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), start=1) if PROCESS_WORDS.search(line)]
    assert not hits, "\n".join(hits)


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert text.index("make demo") < text.index("## Install by hand")  # the two commands come first
    for page in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / page).is_file(), f"README links {page}, which does not exist"


def test_config_reference_names_every_key():
    from orthrus_rag.config.app import AppConf
    from orthrus_rag.config.reference import render_reference

    text = render_reference()

    def keys(cls: type, prefix: str) -> list[str]:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            tp = hints[f.name]
            out += keys(tp, key) if isinstance(tp, type) and dataclasses.is_dataclass(tp) else [key]
        return out

    missing = [k for k in keys(AppConf, "") if f"| `{k}` |" not in text]
    assert not missing, missing
    for group in ("dataset", "corpus", "model", "scheduler", "deploy", "retriever", "pipeline", "experiment"):
        for option in (ROOT / "conf" / group).glob("*.yaml"):
            assert f"| `{option.stem}` |" in text, f"{group}={option.stem} is missing from the reference"


def _results() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


def test_every_result_file_says_where_and_how_it_was_measured():
    files = _results()
    assert files, "no committed benchmark results"
    drawn = set()
    for path in files:
        data = json.loads(path.read_text())
        for key in ("workload", "machine", "measured", "command", "script", "plots", "results"):
            assert data.get(key), f"{path.name}: no {key!r}"
        assert (ROOT / data["script"]).is_file(), f"{path.name}: no script {data['script']}"
        drawn |= set(data["plots"])
    assert len(drawn) >= 6
    committed = {p.name for p in IMAGES.glob("*.png")}
    assert drawn <= committed, f"plots not committed: {sorted(drawn - committed)}"
    assert committed <= drawn, f"committed plots no result file draws: {sorted(committed - drawn)}"


def test_the_report_redraws_every_committed_plot(tmp_path):
    files = _results()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "report.py"), *map(str, files),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for path in files:
        for name in json.loads(path.read_text())["plots"]:
            png = tmp_path / name
            assert png.is_file() and png.stat().st_size > 5_000, f"{path.name} did not draw {name}"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_plot_shown_on_a_page_has_its_redraw_command():
    pages = {p: p.read_text() for p in (ROOT / "docs" / "benchmarks").glob("*.md")}
    for path in _results():
        for name in json.loads(path.read_text())["plots"]:
            shown = [p for p, text in pages.items() if f"img/{name}" in text]
            assert shown, f"{name} is on no benchmarks page"
            assert any(f"report.py docs/benchmarks/results/{path.name}" in pages[p] for p in shown), \
                f"the page showing {name} does not give the command that redraws it"


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is not installed (the dev extra brings mkdocs-material: make install)"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Quick starts" in home and "How fast" in home  # Home is README.md
    reference = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    assert "scheduler.max_num_batched_tokens" in reference  # generated at build time
