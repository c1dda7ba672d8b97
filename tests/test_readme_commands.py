"""README's quick starts run as written, from a folder that holds only `examples/`: every `orthrus-rag` command of
its bash blocks, the server in the background with the openai client's block against it, and the LangChain block.

Left to CI itself: `make demo` / `make test` (the suite is what `make test` runs) and the install lines (they need
the package registry). One substitution: the server's port is a free one, in the command and the client alike."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CLI = shutil.which("orthrus-rag", path=str(Path(sys.executable).parent)) or "orthrus-rag"

pytestmark = pytest.mark.slow


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.DOTALL)


def _commands() -> list[str]:
    """Every `orthrus-rag` command of README's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("orthrus-rag "):
                out.append(line)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", cwd / "examples")
    return cwd


def test_readme_has_the_quick_starts():
    commands = _commands()
    assert any(c.startswith("orthrus-rag index ") for c in commands)
    assert any(c.startswith("orthrus-rag run ") for c in commands)
    assert any(c.startswith("orthrus-rag serve") and c.endswith("&") for c in commands)
    assert len(_blocks("python")) == 2  # the openai client and LangChain


def test_the_corpus_quick_start_runs_as_written(workdir):
    for command in [c for c in _commands() if not c.endswith("&")]:
        argv = shlex.split(command)
        proc = _run([CLI, *argv[1:]], workdir)
        if argv[1] == "summarize":
            assert "EM" in proc.stdout
    summary = json.loads((workdir / "runs" / "example_run" / "summary.json").read_text())
    assert summary["num_questions"] == 4 and summary["num_failed"] == 0 and summary["complete"]
    assert (workdir / "runs" / "example_index" / "index" / "manifest.json").is_file()
    plan = json.loads((workdir / "runs" / "example_run" / "plan.json").read_text())  # what ran the steps
    assert plan["device"] == "cpu" and "decode_attention" in plan["cells"]


def test_the_server_quick_start_answers_the_openai_client(workdir):
    serve = next(c for c in _commands() if c.endswith("&"))
    port = _free_port()
    argv = shlex.split(serve.removesuffix("&").replace("serve.port=8000", f"serve.port={port}"))
    log = (workdir / "server.log").open("w")  # NOTE: a file, not a pipe nobody reads while the server runs
    server = subprocess.Popen([CLI, *argv[1:]], cwd=workdir, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                              stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"the server exited: {(workdir / 'server.log').read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up in 300 s"
                time.sleep(1)
        client = _blocks("python")[0].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        proc = _run([sys.executable, "-c", client], workdir, timeout=300)
        dim, _, text = proc.stdout.strip().partition(" ")
        assert dim == "384" and text  # MiniLM's vectors, and a reply
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def test_the_langchain_quick_start_runs(workdir):
    proc = _run([sys.executable, "-c", _blocks("python")[1]], workdir, timeout=600)
    assert proc.stdout.strip()  # the prediction
