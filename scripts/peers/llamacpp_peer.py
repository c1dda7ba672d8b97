"""llama.cpp "pair" peer: the two servers a llama.cpp user would run for embeddings and generations on this CPU.

llama-server serves one model, and a generation model with `--embedding` serves only embeddings, so the setup is two
servers, one core each (pinned, `-t 1`), at llama.cpp's defaults otherwise (continuous batching on, its own
scheduling, flash attention auto):

- generation: the model's GGUF at `gen_quant` (BF16 by default, made from the shipped file by llama-quantize as
  scripts/peers/llamacpp_bench.py makes it; Q8_0 or the shipped Q4_1 as a user picks them), `slots` parallel
  sequences (`-np`, 64: the load's clients) in a context of `slots` x `ctx_per_slot` tokens;
- embeddings: all-MiniLM-L6-v2 converted once by llama.cpp's own `convert_hf_to_gguf.py` (at `embed_quant`, BF16)
  with `--embedding --pooling mean`, or the generation model's GGUF mean-pooled (the shared-backbone comparison).

Requests go over HTTP to each server's OpenAI-compatible routes (`/v1/completions` with `ignore_eos` as the load
asks, `/v1/embeddings`), from a pool of client threads (one connection each, kept alive); a completion is stamped
when its answer arrives (`time.perf_counter`, as the other peers).

Needs `make peers-llamacpp` (the tools and the llama.cpp source under build/llama.cpp). Runs under this project's
own interpreter.

    peer = LlamaCppPairPeer()
    peer.submit("embed", "e0", "some text", {"return_embedding": True})
    peer.submit("generate", "g0", "a prompt", {"max_tokens": 8, "temperature": 0.0})
    peer.poll(timeout_s=5.0)   # -> [{"request_id", "kind", "finished_at", "n_tokens", ...}]
    peer.shutdown()
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llamacpp_bench  # noqa: E402 (a sibling module: scripts/peers/)
from polling import PollMixin  # noqa: E402

EMBED, GENERATE = "embed", "generate"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embed_gguf(tools: Path, model_dir: Path, name: str, quant: str = "BF16") -> Path:
    """A Hugging Face embedding model (a sentence-transformers folder) as a GGUF, converted once by llama.cpp's own
    converter from the source `make peers-llamacpp` unpacked, kept beside the tools."""
    out = tools.parent / "models" / f"{name}.{quant}.gguf"
    if out.is_file():
        return out
    converter = tools.parent / "src" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise RuntimeError(f"{converter} not found: `make peers-llamacpp` unpacks the llama.cpp source beside the tools")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    proc = subprocess.run([sys.executable, str(converter), str(model_dir), "--outfile", str(tmp), "--outtype",
                           quant.lower()], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    tmp.rename(out)
    return out


class LlamaServer:
    """One llama-server process pinned to `cpus`, on a free loopback port."""

    def __init__(self, tools: Path, model: Path, cpus: list[int], args: list[str], log: Path) -> None:
        self.port = _free_port()
        self.log = log
        cmd = [str(tools / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(len(cpus)), *args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-600:]
                raise RuntimeError(f"llama-server exited {self.proc.returncode} before it answered: {tail}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server on port {self.port} did not answer within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class LlamaCppPairPeer(PollMixin):
    """Two llama-servers (generation on `gen_cpus`, embeddings on `embed_cpus`) behind the peers' submit / poll."""

    def __init__(self, gen_model: str = "smollm2-135m-instruct", embed_model: str = "all-minilm-l6-v2",
                 gen_quant: str = "BF16", embed_quant: str = "BF16", slots: int = 64, ctx_per_slot: int = 512,
                 gen_cpus: tuple[int, ...] = (0,), embed_cpus: tuple[int, ...] = (1,), temperature: float = 0.7,
                 tools: str | None = None, clients: int = 128, startup_timeout_s: float = 300.0,
                 log_dir: str | None = None) -> None:
        from orthrus_rag.models.registry import gguf_source, resolve_model_path

        tools_dir = Path(tools) if tools else llamacpp_bench.DEFAULT_TOOLS
        problem = llamacpp_bench.tools_problem(tools_dir)
        if problem:
            raise RuntimeError(problem)
        source = gguf_source(gen_model)
        if source is None:
            raise ValueError(f"{gen_model} is not a GGUF model (llama.cpp loads only GGUF files)")
        t0 = time.perf_counter()
        gen_file = llamacpp_bench.model_file(tools_dir, source, gen_quant)
        if embed_model == gen_model:  # the shared backbone, mean-pooled
            embed_file = gen_file
        else:
            embed_file = gguf_source(embed_model) or embed_gguf(tools_dir, resolve_model_path(embed_model),
                                                                Path(embed_model).name, embed_quant)
        logs = Path(log_dir) if log_dir else tools_dir.parent / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.temperature = temperature
        self.files = {"generate": gen_file.name, "embed": embed_file.name}
        self._gen = LlamaServer(tools_dir, gen_file, list(gen_cpus),
                            ["-np", str(slots), "-c", str(slots * ctx_per_slot)], logs / "llamacpp-generate.log")
        self._embed = LlamaServer(tools_dir, embed_file, list(embed_cpus),
                              ["--embedding", "--pooling", "mean", "-np", str(slots), "-c",
                               str(slots * ctx_per_slot)], logs / "llamacpp-embed.log")
        try:
            self._gen.wait_healthy(startup_timeout_s)
            self._embed.wait_healthy(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.load_s = time.perf_counter() - t0
        self._cond = threading.Condition()
        self._results: list[dict] = []
        self._errors: list[str] = []
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=clients, thread_name_prefix="llamacpp-client")

    # ------------------------------------------------------------------------------------------------ public API
    def submit(self, kind: str, request_id: str, input_text: str, params_dict: dict | None = None) -> None:
        if kind not in (EMBED, GENERATE):
            raise ValueError(f"kind must be {EMBED!r} or {GENERATE!r}, not {kind!r}")
        self._pool.submit(self._one, kind, str(request_id), input_text, dict(params_dict or {}))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for server in (getattr(self, "_gen", None), getattr(self, "_embed", None)):
            if server is not None:
                server.stop(timeout_s)

    def __enter__(self) -> LlamaCppPairPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------------------ clients
    def _post(self, server: LlamaServer, path: str, body: dict) -> dict:
        """One request on this thread's kept-alive connection to `server` (a new one if the server closed it)."""
        conns = self._local.__dict__.setdefault("conns", {})
        payload = json.dumps(body).encode()
        for attempt in (0, 1):
            conn = conns.get(server.port)
            if conn is None:
                conn = conns[server.port] = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
            try:
                conn.request("POST", path, payload, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                conns.pop(server.port, None)
                if attempt:
                    raise
                continue
            if resp.status != 200:
                raise RuntimeError(f"{path} answered {resp.status}: {data[:300]!r}")
            return json.loads(data)
        raise AssertionError("unreachable")

    def _one(self, kind: str, rid: str, text: str, params: dict) -> None:
        try:
            if kind == GENERATE:
                body = {"prompt": text, "max_tokens": int(params.get("max_tokens", 16)),
                        "temperature": float(params.get("temperature", self.temperature))}
                for name in ("ignore_eos", "top_p", "seed", "stop"):
                    if params.get(name) is not None:
                        body[name] = params[name]
                got = self._post(self._gen, "/v1/completions", body)
                choice = got["choices"][0]
                item = {"request_id": rid, "kind": GENERATE, "n_tokens": int(got["usage"]["completion_tokens"]),
                        "text": choice.get("text", "")}
            else:
                got = self._post(self._embed, "/v1/embeddings", {"input": text})
                item = {"request_id": rid, "kind": EMBED, "n_tokens": 0}
                if params.get("return_embedding"):
                    item["embedding"] = got["data"][0]["embedding"]
        except Exception as exc:  # NOTE: one failed request is reported as such; the load goes on
            item = {"request_id": rid, "kind": kind, "n_tokens": 0, "error": f"{type(exc).__name__}: {exc}"}
        item["finished_at"] = time.perf_counter()
        with self._cond:
            self._results.append(item)
            self._cond.notify_all()
