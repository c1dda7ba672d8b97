"""The llama.cpp pair peer (scripts/peers/llamacpp_peer.py) against a stand-in llama-server: two servers pinned and
started, requests of both kinds answered through the peers' submit / poll with their token counts and vectors, one
failed request reported in its own result while the others complete, and both servers stopped at shutdown."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))
pytestmark = pytest.mark.bench  # a benchmark peer, not the product (make test-bench)

FAKE_SERVER = '''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
embedding = "--embedding" in args
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send(200, {{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/embeddings" and embedding:
            self._send(200, {{"data": [{{"embedding": [0.6, 0.8]}}]}})
        elif self.path == "/v1/completions" and not embedding:
            if body["prompt"] == "fail":
                self._send(500, {{"error": "boom"}})
            else:
                n = body["max_tokens"] if body.get("ignore_eos") else 1
                self._send(200, {{"choices": [{{"text": "x" * n}}], "usage": {{"completion_tokens": n}}}})
        else:
            self._send(404, {{}})

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def tools(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "servers.log"
    for name in ("llama-bench", "llama-batched-bench", "llama-quantize"):
        (folder / name).write_text("#!/bin/sh\nexit 0\n")
    (folder / "llama-server").write_text(FAKE_SERVER.format(python=sys.executable, log=str(log)))
    for path in folder.iterdir():
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return folder, log


def test_the_pair_answers_both_kinds_and_reports_a_failure_in_its_result(tools):
    from llamacpp_peer import LlamaCppPairPeer

    folder, log = tools
    peer = LlamaCppPairPeer(gen_model="smollm2-135m-instruct", embed_model="smollm2-135m-instruct", gen_quant="Q4_1",
                            tools=str(folder), slots=4, ctx_per_slot=256, startup_timeout_s=60,
                            log_dir=str(folder.parent / "logs"))
    try:
        peer.submit("generate", "g0", "hello", {"max_tokens": 5, "ignore_eos": True})
        peer.submit("generate", "g1", "fail", {"max_tokens": 5})
        peer.submit("embed", "e0", "some text", {"return_embedding": True})
        got: dict[str, dict] = {}
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            got.update({r["request_id"]: r for r in peer.poll(timeout_s=1.0)})
    finally:
        peer.shutdown()
    assert got["g0"]["n_tokens"] == 5 and got["g0"]["text"] == "xxxxx" and "error" not in got["g0"]
    assert "500" in got["g1"]["error"]
    assert got["e0"]["embedding"] == [0.6, 0.8] and got["e0"]["kind"] == "embed"
    assert all(r["finished_at"] > 0 for r in got.values())
    started = log.read_text().splitlines()
    assert len(started) == 2 and any("--embedding --pooling mean" in s for s in started)
    assert all("-np 4 -c 1024" in s and "-t 1" in s for s in started)
    assert peer._gen.proc.poll() is not None and peer._embed.proc.poll() is not None  # stopped
