"""Every script under scripts/ says what a user runs it for: a module docstring, and `--help` that exits 0 and
prints it (argparse) or Hydra's own help (scripts/benchmark.py). The modules without a `__main__` block are the
benchmarks' library (scripts/bench/, the peers in scripts/peers/); every top-level file is a script."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # the measuring scripts, not the product (make test-bench)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _is_script(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def _scripts() -> list[Path]:
    return sorted(p for p in SCRIPTS.rglob("*.py") if "__pycache__" not in p.parts and _is_script(p))


def _words(text: str) -> str:
    return " ".join(text.split())


def test_every_top_level_file_is_a_script():
    top = sorted(p.name for p in SCRIPTS.glob("*.py"))
    assert top and top == sorted(p.name for p in _scripts() if p.parent == SCRIPTS)


def test_every_script_has_a_docstring_and_answers_help():
    scripts = _scripts()
    assert len(scripts) >= 15
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def help_of(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=2) as pool:  # each one imports torch: two at a time
        procs = dict(zip(scripts, pool.map(help_of, scripts)))
    failures = []
    for path, proc in procs.items():
        name = path.relative_to(ROOT)
        doc = ast.get_docstring(ast.parse(path.read_text()))
        first = doc.strip().splitlines()[0] if doc and doc.strip() else ""
        out = proc.stdout + proc.stderr
        if not first:
            failures.append(f"{name}: no module docstring")
        elif proc.returncode != 0:
            failures.append(f"{name}: --help exited {proc.returncode}: {out[-800:]}")
        elif "powered by Hydra" in out:  # Hydra prints its own help: the app, its config groups and the config
            assert "== Config ==" in out, f"{name}: {out[-800:]}"
        elif not out.startswith("usage:") or _words(first) not in _words(proc.stdout):
            failures.append(f"{name}: --help does not print the usage and the docstring's first line: {out[:800]}")
    assert not failures, "\n".join(failures)
