"""vLLM "dedicated" peer: the two-engine setup a vLLM user would deploy on this CPU.

One vLLM engine cannot serve both embedding and generation, so there are two engines in two spawned processes,
one core each (VLLM_CPU_OMP_THREADS_BIND=0 / =1), at vLLM's own defaults (dtype "auto": bf16 for generation on
a CPU with bf16, fp16 for the pooling engine, since vLLM prefers fp16 for pooling models; torch.compile on, which
compiles at start-up, a minute or two per engine on one core), each with private VLLM_RPC_BASE_PATH /
VLLM_CACHE_ROOT folders (no compile cache reused across runs), and tcmalloc + the venv's libiomp5 preloaded (LD_PRELOAD at spawn, as vLLM's CPU docs
advise):

- generation engine: SmolLM2-135M-Instruct converted to safetensors (orthrus_rag's cached folder);
- pooling engine: `runner="pooling", convert="embed"` with a MEAN PoolerConfig on the same SmolLM2 (the
  shared-backbone comparison), or all-MiniLM-L6-v2 (`embed_model="all-minilm-l6-v2"`, the separate-model one).

By default each engine is vLLM's usual three processes (our front end -> EngineCore -> Worker). In vllm-cpu 0.32
VLLM_CPU_OMP_THREADS_BIND only acts there: the mp executor puts KMP_AFFINITY / OMP_NUM_THREADS in the worker's
environment; with VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine_core="inproc") nothing is bound, so this module binds
itself. `pin="all"` (default) also confines each engine's whole process tree to its core, so the split is a strict
1 + 1 (with pin="worker" the front ends and engine cores float over both cores and steal from the other engine).

Each front end drives its engine through `LLMEngine.add_request` / `step`, so a request that arrives while a batch
runs joins it at the next step (vLLM's continuous batching), not after the batch. The parent talks to both
through multiprocessing queues; a receiver thread stamps each completion on arrival (caller-side timing,
`time.perf_counter`, which is CLOCK_MONOTONIC and so comparable across processes on Linux).

`dtype="float32"` / `enforce_eager=True` are the former settings (`peer_options.vllm.dtype=float32`,
`peer_options.vllm.enforce_eager=true` in scripts/bench/conf/bench.yaml); `embed_dtype` overrides the pooling
engine's alone (e.g. bfloat16: vLLM's fp16 default has no native fp16 dot products on most x86 CPUs).

Needs the peers venv (`make peers`): run the driver with `.venv-peers/bin/python`, under
`if __name__ == "__main__":` (spawn re-imports the main module).

    peer = VllmDedicatedPeer()
    peer.submit("embed", "e0", "some text", {"return_embedding": True, "truncate": True})
    peer.submit("generate", "g0", "a prompt", {"max_tokens": 8, "temperature": 0.0})
    peer.poll(timeout_s=5.0)   # -> [{"request_id", "kind", "finished_at", "n_tokens", ...}]
    peer.shutdown()
"""

from __future__ import annotations

import atexit
import importlib.util
import multiprocessing as mp
import multiprocessing.util
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from polling import PollMixin  # noqa: E402 (a sibling module: scripts/peers/)

EMBED, GENERATE = "embed", "generate"
TCMALLOC_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
]


def preload_libs() -> list[str]:
    """tcmalloc (Debian libtcmalloc-minimal4) and the libiomp5.so that vllm-cpu's intel-openmp puts in the venv."""
    libs = [p for p in TCMALLOC_CANDIDATES if os.path.isfile(p)][:1]
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file():
        libs.append(str(iomp))
    return libs


def resolve(name: str) -> str:
    """A model folder for a built-in name (orthrus_rag's registry), or the path as given."""
    if os.path.isdir(name):
        return name
    from orthrus_rag.models.registry import resolve_model_path

    return str(resolve_model_path(name))


# ---------------------------------------------------------------- child process (one engine) ----------------------


def _engine_main(role: str, model: str, llm_kwargs: dict, env: dict, pin_cpus: list[int] | None, in_q,
                 out_q) -> None:
    """Runs in a spawned process: build one vLLM engine, serve queued requests with add_request/step, exit."""
    os.environ.update(env)
    if pin_cpus:
        os.sched_setaffinity(0, pin_cpus)  # this process and all it starts (engine core, worker) stay on these
    parent = multiprocessing.parent_process()
    llm = None
    try:
        from vllm import LLM, PoolingParams, SamplingParams
        from vllm.config import PoolerConfig
        from vllm.sampling_params import RequestOutputKind

        if isinstance(llm_kwargs.get("pooler_config"), dict):  # built here so the parent need not import vllm
            llm_kwargs = {**llm_kwargs, "pooler_config": PoolerConfig(**llm_kwargs["pooler_config"])}
        t0 = time.perf_counter()
        llm = LLM(model=model, **llm_kwargs)
        engine = llm.llm_engine
        out_q.put({"event": "ready", "role": role, "pid": os.getpid(), "load_s": time.perf_counter() - t0})

        kinds: dict[str, str] = {}
        extras: dict[str, dict] = {}
        stopping = False
        while True:
            busy = engine.has_unfinished_requests()
            msgs = []
            while not busy and not stopping and not msgs:  # idle: block until work (or stop) arrives
                try:
                    msgs.append(in_q.get(timeout=1.0))
                except queue.Empty:
                    if parent is not None and not parent.is_alive():  # orphaned: stop rather than linger
                        stopping = True
            while True:
                try:
                    msgs.append(in_q.get_nowait())
                except queue.Empty:
                    break
            for msg in msgs:
                if msg[0] == "stop":
                    stopping = True
                    continue
                _, kind, rid, text, params = msg
                params = dict(params or {})
                want = {k: params.pop(k) for k in ("return_text", "return_embedding", "truncate") if k in params}
                try:
                    prompt: Any = text
                    if kind == GENERATE:
                        if "structured_outputs" in params:  # a dict of vLLM's StructuredOutputsParams fields
                            from vllm.sampling_params import StructuredOutputsParams

                            params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
                        sp = SamplingParams(**params)
                        sp.output_kind = RequestOutputKind.FINAL_ONLY
                    else:
                        sp = PoolingParams(task="embed", **params)
                        if want.get("truncate"):  # cut at the model's window as sentence-transformers does
                            prompt = {"prompt_token_ids": llm.get_tokenizer()(
                                text, truncation=True, max_length=engine.model_config.max_model_len)["input_ids"]}
                    engine.add_request(rid, prompt, sp)
                    kinds[rid] = kind
                    extras[rid] = want
                except Exception as exc:  # a bad request must not kill the engine
                    out_q.put({"event": "done", "request_id": rid, "kind": kind, "n_tokens": 0,
                               "error": f"{type(exc).__name__}: {exc}"})
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    rid = out.request_id
                    kind = kinds.pop(rid, role)
                    want = extras.pop(rid, {})
                    res: dict[str, Any] = {"event": "done", "request_id": rid, "kind": kind}
                    if kind == GENERATE:
                        comp = out.outputs[0]
                        res["n_tokens"] = len(comp.token_ids)
                        res["prompt_tokens"] = len(out.prompt_token_ids or [])
                        res["cached_tokens"] = int(getattr(out, "num_cached_tokens", 0) or 0)
                        res["text"] = comp.text
                        if comp.logprobs is not None:  # asked for (FLARE): each sampled token's own logprob
                            res["token_ids"] = list(comp.token_ids)
                            res["logprobs"] = [[t, pos[t].logprob] for t, pos in zip(comp.token_ids, comp.logprobs)]
                    else:
                        res["n_tokens"] = len(out.prompt_token_ids or [])
                        if want.get("return_embedding"):
                            res["embedding"] = out.outputs.data.tolist()
                    out_q.put(res)
            elif stopping:
                break
    except BaseException as exc:  # report and exit; the parent raises
        out_q.put({"event": "error", "role": role, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()  # without it the process may hang or abort at exit
            except Exception:
                pass
        out_q.put({"event": "bye", "role": role})
        out_q.close()
        out_q.join_thread()
        # os._exit skips interpreter teardown (where an engine may hang or abort) but also multiprocessing's
        # finalizers: run those, or semaphores made here (tqdm's lock) show up as leaked at the parent's exit
        multiprocessing.util._run_finalizers(0)
    os._exit(0)


# ---------------------------------------------------------------- parent side ------------------------------------


class VllmDedicatedPeer(PollMixin):
    """Two vLLM engines (generation, pooling), one core each, behind submit / poll / shutdown."""

    def __init__(self, gen_model: str = "smollm2-135m-instruct", embed_model: str = "smollm2-135m-instruct", *,
                 gen_cpus: str = "0", embed_cpus: str = "1", dtype: str = "auto", embed_dtype: str | None = None,
                 enforce_eager: bool = False, max_model_len: int = 2048, kv_cache_gib: int = 1,
                 gen_kwargs: dict | None = None, embed_kwargs: dict | None = None,
                 engine_core: str = "mp", pin: str = "all", start_timeout_s: float = 600.0,
                 workdir: str | None = None, quiet: bool = True) -> None:
        """engine_core="mp" (vLLM's default: engine core and worker in processes of their own; the worker's OpenMP
        threads are bound by VLLM_CPU_OMP_THREADS_BIND) or "inproc" (VLLM_ENABLE_V1_MULTIPROCESSING=0: one process
        per engine; vLLM's uniproc executor applies no binding, so OMP_NUM_THREADS / KMP_AFFINITY are set here).
        pin="all" also confines each engine's whole process tree (front end, engine core, worker) to its cores, so
        the split is a strict 1 + 1; pin="worker" leaves the front ends and engine cores free to float.
        dtype / enforce_eager: vLLM's `LLM` arguments ("auto" and False are vLLM's defaults; "float32" and True
        the eager fp32 peer of earlier runs); embed_dtype: the pooling engine's dtype when it should differ."""
        if engine_core not in ("mp", "inproc") or pin not in ("all", "worker"):
            raise ValueError("engine_core must be 'mp' or 'inproc' and pin 'all' or 'worker'")
        self._ctx = mp.get_context("spawn")
        self._workdir = Path(workdir or tempfile.mkdtemp(prefix="vllm_peer_"))
        self._own_workdir = workdir is None
        self._out_q = self._ctx.Queue()
        self._in_q = {GENERATE: self._ctx.Queue(), EMBED: self._ctx.Queue()}
        self._results: list[dict] = []
        self._cond = threading.Condition()
        self._errors: list[str] = []
        self._bye: set[str] = set()
        self.load_s: dict[str, float] = {}
        self.pids: dict[str, int] = {}

        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(f"vllm is not installed in {sys.prefix}: `make peers`, then use .venv-peers/bin/python")
        gen_path, embed_path = resolve(gen_model), resolve(embed_model)
        common = {"enforce_eager": True} if enforce_eager else {}  # False: vLLM's default (compiled)
        gen_llm = {"dtype": dtype, "max_model_len": max_model_len, **common, **(gen_kwargs or {})}
        embed_llm = {"dtype": embed_dtype or dtype, "runner": "pooling", **common, **(embed_kwargs or {})}
        embed_is_decoder = _is_decoder(embed_path)
        if embed_is_decoder:  # an encoder (MiniLM: 256) keeps the length its config derives
            embed_llm.setdefault("max_model_len", max_model_len)
        if "convert" not in embed_llm and "pooler_config" not in embed_llm and embed_is_decoder:
            # a causal LM as an embedding model: mean over all tokens, L2-normalised (vLLM's default for embed)
            embed_llm.update(convert="embed", pooler_config={"pooling_type": "MEAN"})
        self.models = {GENERATE: gen_path, EMBED: embed_path}

        self._procs: dict[str, Any] = {}
        libs = preload_libs()
        for role, path, llm_kwargs, cpus in ((GENERATE, gen_path, gen_llm, gen_cpus),
                                             (EMBED, embed_path, embed_llm, embed_cpus)):
            private = self._workdir / role
            (private / "rpc").mkdir(parents=True, exist_ok=True)
            (private / "cache").mkdir(parents=True, exist_ok=True)
            env = {
                "VLLM_CPU_OMP_THREADS_BIND": cpus,
                "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                "VLLM_RPC_BASE_PATH": str(private / "rpc"),
                "VLLM_CACHE_ROOT": str(private / "cache"),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if engine_core == "mp" else "0",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
            cpu_ids = _parse_cpus(cpus)
            if engine_core == "inproc":  # what vLLM's mp executor would set for its worker (iomp flavour)
                env.update(OMP_NUM_THREADS=str(len(cpu_ids)), KMP_BLOCKTIME="5", KMP_TPAUSE="0",
                           KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{','.join(map(str, cpu_ids))}]")
            pin_cpus = cpu_ids if (pin == "all" or engine_core == "inproc") else None
            if quiet:
                env["VLLM_LOGGING_LEVEL"] = "WARNING"
            # not daemonic: with engine_core="mp" the process starts vLLM's own engine-core process
            proc = self._ctx.Process(target=_engine_main, name=f"vllm-{role}", daemon=False,
                                     args=(role, path, llm_kwargs, env, pin_cpus, self._in_q[role], self._out_q))
            # LD_PRELOAD must be in the environment at exec: set it for the spawn only, not for this process
            saved = os.environ.get("LD_PRELOAD")
            if libs:
                os.environ["LD_PRELOAD"] = ":".join(libs + ([saved] if saved else []))
            try:
                proc.start()
            finally:
                if saved is None:
                    os.environ.pop("LD_PRELOAD", None)
                else:
                    os.environ["LD_PRELOAD"] = saved
            self._procs[role] = proc
            self.pids[role] = proc.pid

        atexit.register(self.shutdown)  # non-daemonic children: never leave them behind
        self._receiver = threading.Thread(target=self._receive, name="vllm-peer-receiver", daemon=True)
        self._receiver.start()
        deadline = time.monotonic() + start_timeout_s
        with self._cond:
            while len(self.load_s) < 2:
                if self._errors:
                    break
                if time.monotonic() > deadline:
                    self._errors.append(f"engines not ready after {start_timeout_s:.0f}s")
                    break
                if any(not p.is_alive() for p in self._procs.values()) and len(self.load_s) < 2:
                    self._cond.wait(1.0)  # a dying child posts its error first
                    if not self._errors and any(not p.is_alive() for p in self._procs.values()):
                        self._errors.append("an engine process died during start-up")
                    continue
                self._cond.wait(0.5)
        if self._errors:
            err = "; ".join(self._errors)
            self.shutdown()
            raise RuntimeError(f"vLLM peer failed to start: {err}")

    def _receive(self) -> None:
        while len(self._bye) < 2:
            try:
                msg = self._out_q.get(timeout=1.0)
            except queue.Empty:
                if all(not p.is_alive() for p in self._procs.values()):
                    break
                continue
            now = time.perf_counter()
            event = msg.pop("event")
            with self._cond:
                if event == "done":
                    msg["finished_at"] = now
                    self._results.append(msg)
                elif event == "ready":
                    self.load_s[msg["role"]] = msg["load_s"]
                elif event == "error":
                    self._errors.append(f"{msg['role']}: {msg['error']}")
                elif event == "bye":
                    self._bye.add(msg["role"])
                self._cond.notify_all()

    def submit(self, kind: str, request_id: str, input_text: str, params_dict: dict | None = None) -> None:
        """Queue a request; `params_dict` are vLLM SamplingParams (generate) or PoolingParams (embed) fields."""
        if kind not in self._in_q:
            raise ValueError(f"kind must be {EMBED!r} or {GENERATE!r}, not {kind!r}")
        if self._errors:
            raise RuntimeError("; ".join(self._errors))
        self._in_q[kind].put(("req", kind, str(request_id), input_text, params_dict or {}))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop both engines (each shuts its engine core down and exits), then reap the processes."""
        atexit.unregister(self.shutdown)
        for role, proc in getattr(self, "_procs", {}).items():
            if proc.is_alive():
                self._in_q[role].put(("stop",))
        deadline = time.monotonic() + timeout_s
        for proc in getattr(self, "_procs", {}).values():
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._procs = {}
        if getattr(self, "_receiver", None) is not None:
            self._receiver.join(5)
        if self._own_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> VllmDedicatedPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _parse_cpus(spec: str) -> list[int]:
    """'0', '0,2' or '0-3' -> a list of CPU ids."""
    ids: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


def _is_decoder(path: str) -> bool:
    import json

    try:
        archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except OSError:
        return False
    return any(a.endswith("ForCausalLM") for a in archs)
