"""Load drivers over an `EngineClient`, measured from the caller side (coroutines: a `Session` runs them).

- `closed_loop`: C clients; each sends its next request when its previous one finished, for T seconds or N
  requests (the ratio sweep, the three phases with at most C in flight).
- `open_loop`: requests sent at their scheduled `arrival_s` (Poisson arrivals, the FCFS-blocking burst).
Per request: kind, start (sent, or the scheduled arrival in open loop), finish and latency. Alongside: the per-step
token mix of a client whose steps it can see (`EngineClient.observe_steps`: an in-process engine) and the CPU use of
this process tree per second. A request still unfinished when the run ends is cancelled (which aborts it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from orthrus_rag.engine.clients import EngineClient
from orthrus_rag.engine.core.request import RequestKind
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput

from .workloads import RequestSpec

logger = logging.getLogger(__name__)
KINDS = ("embed", "generate")
SCORE = "score"  # a rerank call (workloads.make_score_request): summarized only in runs that send one


@dataclass
class RequestRecord:
    request_id: str
    kind: str
    start_s: float  # seconds after the run started
    finish_s: float | None = None
    num_output_tokens: int = 0  # a score request: the documents it scored
    error: str | None = None
    tags: dict = field(default_factory=dict)

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.start_s


@dataclass
class RunResult:
    label: str
    window_s: float  # the measurement window: requests finished within it count
    records: list[RequestRecord]
    steps: list[dict]  # per engine step: t (s), embed / prefill / decode / encoder tokens, step_time
    cpu: list[tuple[float, float]]  # (t, CPU % of one core, this process and its children)
    warmup_s: float = 0.0  # completions before this are not counted (the clients' synchronized start)

    def to_dict(self) -> dict:
        return {"label": self.label, "window_s": self.window_s, "warmup_s": self.warmup_s,
                "records": [asdict(r) for r in self.records], "steps": self.steps, "cpu": self.cpu}

    @classmethod
    def from_dict(cls, d: dict) -> "RunResult":
        """`to_dict`'s inverse (a run read back from results.json or from a peer's subprocess)."""
        return cls(d["label"], d["window_s"], [RequestRecord(**r) for r in d["records"]], d["steps"],
                   [tuple(c) for c in d["cpu"]], d.get("warmup_s", 0.0))


class CpuSampler:
    """Samples CPU use of this process tree every `interval_s` in a daemon thread (psutil, else /proc)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def start(self, t0: float) -> "CpuSampler":
        self._t0 = t0
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join(2 * self.interval_s)
        return self.samples

    def _loop(self) -> None:
        read = _psutil_reader() or _proc_reader()
        read()  # baseline
        while not self._stop.wait(self.interval_s):
            self.samples.append((round(time.monotonic() - self._t0, 3), round(read(), 1)))


def _psutil_reader():
    try:
        import psutil
    except ImportError:
        return None
    me, known = psutil.Process(), {}

    def read() -> float:
        total = 0.0
        for p in [me, *me.children(recursive=True)]:
            try:  # NOTE: a Process object's first cpu_percent is 0; keep them so later calls measure a delta
                total += known.setdefault(p.pid, p).cpu_percent(None)
            except psutil.NoSuchProcess:
                known.pop(p.pid, None)
        return total
    return read


def _proc_reader():
    tick, last = os.sysconf("SC_CLK_TCK"), [time.monotonic(), 0.0]

    def ticks(pid: str) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        kids = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += f.read().split()
        return float(fields[11]) + float(fields[12]) + sum(ticks(k) for k in kids)

    def read() -> float:
        now, total = time.monotonic(), ticks(str(os.getpid())) / tick
        pct = 100.0 * (total - last[1]) / max(now - last[0], 1e-9)
        last[:] = [now, total]
        return pct
    return read


class _Tracker:
    """Requests in flight (one task each, awaiting the client) and their records, relative to `t0`."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.t0 = time.monotonic()
        self.inflight: dict[str, asyncio.Task] = {}
        self.records: list[RequestRecord] = []
        self.step_log: list[tuple[float, object]] = []
        # NOTE: the observer runs on the engine's thread; a list append is atomic there
        self._unobserve = client.observe_steps(lambda stats: self.step_log.append((time.monotonic(), stats)))
        self.sampler = CpuSampler().start(self.t0)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def submit(self, req: RequestSpec, start_s: float | None = None) -> asyncio.Task:
        """Send one request now; the task ends when its record is complete (never raises but CancelledError)."""
        kind = RequestKind(req.kind)  # NOTE: a ValueError naming the kinds, before anything is recorded
        rec = RequestRecord(req.request_id, req.kind, self.now() if start_s is None else start_s, tags=dict(req.tags))
        self.records.append(rec)
        task = asyncio.ensure_future(self._serve(kind, req, rec))
        self.inflight[req.request_id] = task
        task.add_done_callback(lambda _: self.inflight.pop(req.request_id, None))
        return task

    async def _serve(self, kind: RequestKind, req: RequestSpec, rec: RequestRecord) -> None:
        try:
            if kind is RequestKind.SCORE:
                query, documents = req.input
                scores = await self.client.score(query, list(documents), req.params)  # type: ignore[attr-defined]
                rec.finish_s, rec.num_output_tokens = self.now(), len(scores)
                return
            call = self.client.generate if kind is RequestKind.GENERATE else self.client.embed
            out = await call(req.input, req.params, req.request_id)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 (this request's failure, recorded; the run goes on)
            rec.finish_s, rec.error = self.now(), f"{type(exc).__name__}: {exc}"
            return
        rec.finish_s = self.now()
        if isinstance(out, GenerationOutput):
            rec.num_output_tokens = len(out.token_ids)
            if out.finish_reason in ("error", "abort"):
                rec.error = out.finish_reason
        elif isinstance(out, EmbeddingOutput) and out.error:
            rec.error = out.error

    async def finish(self, limit_s: float, workers: Iterable[asyncio.Task] = ()) -> None:
        """Wait for `workers` and every request in flight until `limit_s` (run time); cancel what is left."""
        waiting = [*workers, *self.inflight.values()]
        if waiting:
            await asyncio.wait(waiting, timeout=max(0.0, limit_s - self.now()))
        left = [t for t in [*waiting, *self.inflight.values()] if not t.done()]
        if self.inflight:
            logger.warning("%d requests unfinished at the end of the run; cancelled", len(self.inflight))
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def result(self, label: str, window_s: float | None) -> RunResult:
        cpu = self.sampler.stop()
        if self._unobserve is not None:
            self._unobserve()
        if window_s is None:
            window_s = max((r.finish_s for r in self.records if r.finish_s is not None), default=0.0)
        steps = [{"t": round(t - self.t0, 4), "embed": s.num_embed_tokens, "prefill": s.num_prefill_tokens,
                  "decode": s.num_decode_tokens, "encoder": s.num_encoder_tokens, "step_time": s.step_time,
                  "gaps": [round(g, 5) for g in s.decode_gaps], "time_capped": s.time_capped,
                  "yielded": s.num_yielded_decodes, "embed_at_risk": s.embed_at_risk,
                  "generate_at_risk": s.generate_at_risk,
                  "predicted_step_time": s.predicted_step_time}
                 for t, s in list(self.step_log)]
        return RunResult(label, window_s, self.records, steps, cpu)


async def closed_loop(client: EngineClient, requests: Iterable[RequestSpec], concurrency: int,
                      duration_s: float | None = None, max_requests: int | None = None,
                      drain_timeout_s: float = 120.0, label: str = "", warmup_s: float = 0.0) -> RunResult:
    """`concurrency` clients send back to back until `duration_s` passes, `max_requests` were sent or `requests`
    runs out; then in-flight requests drain (they count only if they finished within the window). The run stops
    at `duration_s + drain_timeout_s` (or `drain_timeout_s` without a duration) whatever is left.
    `warmup_s`: completions before it are left out of the summary (throughput over `duration_s - warmup_s`)."""
    if duration_s is not None and not 0.0 <= warmup_s < duration_s:
        raise ValueError(f"warmup_s must be in [0, duration_s), got {warmup_s} for duration {duration_s}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    it: Iterator[RequestSpec] = iter(requests)
    tr, sent = _Tracker(client), 0

    def next_request() -> RequestSpec | None:
        nonlocal sent
        if (duration_s is not None and tr.now() >= duration_s) or (max_requests is not None and sent >= max_requests):
            return None
        req = next(it, None)
        sent += req is not None
        return req

    async def one_client() -> None:
        while (req := next_request()) is not None:
            await tr.submit(req)

    workers = [asyncio.ensure_future(one_client()) for _ in range(concurrency)]
    # NOTE: bounded either way: without a duration, drain_timeout_s bounds the whole run
    await tr.finish((duration_s or 0.0) + drain_timeout_s, workers)
    res = tr.result(label, duration_s)
    res.warmup_s = warmup_s
    return res


async def open_loop(client: EngineClient, schedule: list[RequestSpec], duration_s: float | None = None,
                    drain_timeout_s: float = 120.0, label: str = "") -> RunResult:
    """Send each request at its `arrival_s`; its latency counts from that scheduled time (so a late send caused
    by a busy caller counts against the system it runs in)."""
    pending = sorted(schedule, key=lambda r: r.arrival_s)
    tr = _Tracker(client)
    # NOTE: bounded: sending ends at duration_s (else at the last arrival), then drain_timeout_s at most
    last = pending[-1].arrival_s if pending else 0.0
    limit = (last if duration_s is None else min(duration_s, last)) + drain_timeout_s
    for req in pending:
        if duration_s is not None and req.arrival_s >= duration_s:
            break
        if (wait := req.arrival_s - tr.now()) > 0:
            await asyncio.sleep(wait)
        tr.submit(req, start_s=req.arrival_s)
    await tr.finish(limit)
    return tr.result(label, duration_s)


def summarize(result: RunResult) -> dict:
    """Per kind: completed within the window (after the warm-up), requests/s, latency p50/p95/p99; the step mix
    and mean CPU over the whole run."""
    out: dict = {"label": result.label, "window_s": result.window_s, "kinds": {},
                 "unfinished": sum(r.finish_s is None for r in result.records)}
    measured = result.window_s - result.warmup_s
    for kind in (*KINDS, SCORE) if any(r.kind == SCORE for r in result.records) else KINDS:
        done = [r for r in result.records if r.kind == kind and r.finish_s is not None
                and result.warmup_s < r.finish_s <= result.window_s + 1e-9 and r.error is None]
        lat = np.array([r.latency_s for r in done]) if done else np.zeros(0)
        pct = np.percentile(lat, [50, 95, 99]).tolist() if len(lat) else [float("nan")] * 3
        out["kinds"][kind] = {
            "completed": len(done), "throughput_rps": len(done) / measured if measured > 0 else 0.0,
            "p50_s": pct[0], "p95_s": pct[1], "p99_s": pct[2],
            "mean_s": float(lat.mean()) if len(lat) else float("nan"),
            "errors": sum(r.kind == kind and r.error is not None for r in result.records)}
    if result.steps:
        n = len(result.steps)
        out["steps"] = {k: sum(s[k] for s in result.steps) for k in ("embed", "prefill", "decode", "encoder")}
        out["steps"].update(num_steps=n, mixed_frac=sum(
            (s["embed"] + s["encoder"]) > 0 and (s["prefill"] + s["decode"]) > 0 for s in result.steps) / n)
        # a decode's inter-token gaps (what slo.itl_s bounds) and how often a latency target acted
        gaps = np.array([g for s in result.steps for g in s.get("gaps", [])])
        out["steps"].update(
            itl_p50_s=float(np.percentile(gaps, 50)) if len(gaps) else None,
            itl_p95_s=float(np.percentile(gaps, 95)) if len(gaps) else None,
            itl_max_s=float(gaps.max()) if len(gaps) else None,
            yielded_decodes=sum(s.get("yielded", 0) for s in result.steps),
            **{f"{key}_frac": sum(bool(s.get(key)) for s in result.steps) / n
               for key in ("time_capped", "embed_at_risk", "generate_at_risk")})
    out["cpu_mean_pct"] = float(np.mean([c for _, c in result.cpu])) if result.cpu else None
    return out


def rows(results: dict[str, dict[str, dict]], groups: list[str]) -> list[dict]:
    """`summarize()` of every (system, group) run of an experiment's `{system: {group: RunResult dict}}`, ordered by
    group then system, with `system` and `group`."""
    out = []
    for g in groups:
        for system, runs in results.items():
            if g in runs:
                out.append({"system": system, "group": g, **summarize(RunResult.from_dict(runs[g]))})
    return out


def by_group(results: dict[str, dict[str, dict]], group: str) -> dict[str, dict]:
    """system -> run of one group (what the latency-CDF and step-mix plots take)."""
    return {system: runs[group] for system, runs in results.items() if group in runs}
