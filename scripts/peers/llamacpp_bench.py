"""llama.cpp side of `scripts/bench_engine.py` (`--peers llamacpp`): the engine micro-benchmark's measurements on
llama.cpp's own benchmark tools, as its users run them (`make peers` builds them from the llama.cpp source that
llama-cpp-python ships on PyPI, for this CPU).

- Model files: one per quantization, made from the model's GGUF by `llama-quantize --allow-requantize` and kept
  beside the tools (`<tools>/../models/`); the quantization the source file already has is the file itself. The
  same weights the engine loads from that file, so every column is one model.
- prefill tokens/s: `llama-bench -p L -n 0` (its mean over its 5 repetitions), one L-token prompt at a time, as
  the engine's prefill rows run L-token chunks.
- decode tokens/s at batch B: `llama-batched-bench -npp P -ntg T -npl B1,B2,...`: its S_TG, B x T generated tokens
  over the generation time, prompts excluded (the engine's rate subtracts a 1-token run for the same reason).
- Every tool runs with `-t <threads>` and pinned to the engine's cores, at llama.cpp's defaults otherwise.

Stdlib only, so tests/test_bench_llamacpp_side.py runs without the tools.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOOLS = ROOT / "build" / "llama.cpp" / "bin"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
# the forms llama-quantize writes that llama.cpp's users pick for CPUs, largest first
QUANTS = ("F32", "BF16", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0")
DEFAULT_QUANTS = ("BF16", "Q8_0", "Q4_1")
_FILE_QUANT = re.compile(r"[.-](F32|BF16|F16|Q\d(?:_K)?(?:_[01SML])*)\.gguf$", re.IGNORECASE)


def parse_quants(spec: str) -> list[str]:
    """'BF16,Q8_0,q4_k_m' -> ['BF16', 'Q8_0', 'Q4_K_M']; an unknown form raises ValueError naming the known ones."""
    out: list[str] = []
    for name in (s.strip().upper() for s in spec.split(",")):
        if not name:
            continue
        if name not in QUANTS:
            raise ValueError(f"unknown llama.cpp quantization {name!r}; expected one of {', '.join(QUANTS)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("no llama.cpp quantization given (e.g. BF16,Q8_0,Q4_1)")
    return out


def file_quant(path: str | Path) -> str | None:
    """The quantization a GGUF file's name says it holds (`SmolLM2-135M-Instruct.Q4_1.gguf` -> 'Q4_1'), if any."""
    m = _FILE_QUANT.search(Path(path).name)
    return m.group(1).upper() if m else None


def tools_problem(folder: str | Path) -> str | None:
    """Why the llama.cpp tools cannot run from `folder`, or None."""
    missing = [t for t in TOOLS if not os.access(Path(folder) / t, os.X_OK)]
    if missing:
        return f"{', '.join(missing)} not in {folder}: build them with `make peers` (or give --llamacpp-dir)"
    return None


def model_file(tools: Path, source: Path, quant: str, timeout_s: float = 1800.0) -> Path:
    """The GGUF of `source`'s model at `quant`: the source itself when it is already that form, else made once by
    llama-quantize under `<tools>/../models/`."""
    if file_quant(source) == quant:
        return source
    stem = _FILE_QUANT.sub("", source.name) if file_quant(source) else source.stem
    out = tools.parent / "models" / f"{stem}.{quant}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    proc = subprocess.run([str(tools / "llama-quantize"), "--allow-requantize", str(source), str(tmp), quant],
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {quant} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    tmp.rename(out)
    return out


def prefill_command(tools: Path, model: Path, threads: int, prompt_len: int) -> list[str]:
    return [str(tools / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt_len), "-n", "0",
            "-o", "json"]


def decode_command(tools: Path, model: Path, threads: int, prompt_len: int, tokens: int,
                   batches: list[int]) -> list[str]:
    # NOTE: the context holds every sequence's prompt and output (prompts not shared), rounded up to 256
    ctx = -(-max(batches) * (prompt_len + tokens) // 256) * 256
    return [str(tools / "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-c", str(ctx),
            "-npp", str(prompt_len), "-ntg", str(tokens), "-npl", ",".join(map(str, batches)),
            "--output-format", "jsonl"]


def parse_prefill(stdout: str) -> float:
    """llama-bench's JSON: the mean tokens/s of its prompt test."""
    rows = [r for r in json.loads(stdout) if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
    if not rows:
        raise ValueError("llama-bench printed no prompt-processing result")
    return float(rows[0]["avg_ts"])


def parse_decode(stdout: str) -> dict[int, float]:
    """llama-batched-bench's JSONL: generation tokens/s (S_TG) by batch size."""
    out = {}
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            out[int(row["pl"])] = float(row["speed_tg"])
    if not out:
        raise ValueError("llama-batched-bench printed no generation result")
    return out


def _run(cmd: list[str], cpus: list[int], timeout_s: float) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def measure(tools: str | Path, source: str | Path, quant: str, workload: dict[str, Any], cpus: list[int],
            timeout_s: float = 1800.0) -> dict[str, Any]:
    """One quantization's row set: {"results": {metric: value}, "meta": {"file", "file_bytes"}, "error"}, with
    bench_engine's metric names. `workload`: its sections, batches and token counts."""
    tools, source = Path(tools), Path(source)
    threads = len(cpus)
    try:
        model = model_file(tools, source, quant, timeout_s)
        results: dict[str, float] = {}
        if "prefill" in workload["sections"]:
            out = _run(prefill_command(tools, model, threads, workload["prefill_len"]), cpus, timeout_s)
            results["prefill_tok_s"] = parse_prefill(out)
        if "decode" in workload["sections"]:
            out = _run(decode_command(tools, model, threads, workload["decode_prompt_len"], workload["decode_tokens"],
                                      workload["batches"]), cpus, timeout_s)
            results.update({f"decode_tok_s_b{b}": v for b, v in parse_decode(out).items()})
        return {"results": results, "meta": {"file": model.name, "file_bytes": model.stat().st_size}, "error": None}
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as exc:
        return {"results": {}, "meta": {}, "error": f"{type(exc).__name__}: {exc}"}


def format_table(engine: dict[str, dict], llamacpp: dict[str, dict]) -> str:
    """Markdown: one row per metric; a column per engine variant (label -> results) and per llama.cpp
    quantization (-> measure()'s dict); then the engine's best over llama.cpp's best on that row."""
    metrics = [k for k in next(iter(engine.values()), {})]
    head = ["metric"] + [f"orthrus_rag {k}" for k in engine] + [f"llama.cpp {q}" for q in llamacpp]
    head.append("best / llama.cpp best")
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in metrics:
        ours = [v.get(m) for v in engine.values()]
        theirs = [(p.get("results") or {}).get(m) for p in llamacpp.values()]
        cells = [m] + [_num(v) for v in ours]
        cells += [_num(v) if v is not None else ("error" if p.get("error") else "–")
                  for p, v in zip(llamacpp.values(), theirs)]
        best_ours = max((v for v in ours if v is not None), default=None)
        best_theirs = max((v for v in theirs if v is not None), default=None)
        cells.append(f"{best_ours / best_theirs:.2f}x" if best_ours and best_theirs else "–")
        rows.append("| " + " | ".join(cells) + " |")
    notes = [f"- llama.cpp {q}: ERROR {p['error']}" if p.get("error") else
             f"- llama.cpp {q}: {p['meta']['file']} ({p['meta']['file_bytes'] / 2**20:.0f} MiB)"
             for q, p in llamacpp.items()]
    return "\n".join(rows + [""] + notes)


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:,.1f}"
