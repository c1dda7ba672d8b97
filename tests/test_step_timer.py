"""Step timing for the cost model (`run_timed` in engine/executor/runner.py): on CUDA a step is timed by CUDA
events and waited for at its end (a host clock would read launch time); elsewhere by the host clock. The engine and the start-up
calibration both learn the runner's measured seconds. CUDA is stood in for by fake events here; the GPU set
(tests/test_gpu_engine.py) checks the cost model against real CUDA-event timing."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig

from orthrus_rag import CacheConfig, Engine, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from orthrus_rag.engine.executor.calibration import calibrate
from orthrus_rag.engine.executor.runner import RunnerOutput, run_timed
from orthrus_rag.engine.core.step_cost import StepCostModel
from orthrus_rag.models.llama import CausalLM


def test_on_the_cpu_the_host_clock_is_the_step_time():
    result, seconds = run_timed(torch.device("cpu"), lambda: time.sleep(0.05) or "done")
    assert result == "done" and 0.05 <= seconds < 0.5


class _Events:
    """torch.cuda.Event as far as the timer uses it, logging every call; the device takes 250 ms per step."""

    log: list[str] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "events without timing cannot measure a step"
        self.name = "begin" if not any(e.startswith("new") for e in self.log) else "end"
        self.log.append(f"new {self.name}")
        self.done = False

    def record(self, stream: object = None) -> None:
        assert stream == "stream of cuda:1", "recorded on another device's stream"
        self.log.append(f"record {self.name}")

    def synchronize(self) -> None:
        self.done = True
        self.log.append(f"synchronize {self.name}")

    def elapsed_time(self, end: "_Events") -> float:
        assert end.done, "elapsed_time read before the end event completed"
        return 250.0


def test_on_cuda_a_step_is_timed_by_events_and_waited_for(monkeypatch):
    _Events.log = []
    monkeypatch.setattr(torch.cuda, "Event", _Events)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    result, seconds = run_timed(torch.device("cuda:1"), lambda: _Events.log.append("step") or 7)
    assert result == 7
    assert seconds == pytest.approx(0.25)  # the device's time, though the host returned at once
    assert _Events.log == ["new begin", "new end", "record begin", "step", "record end", "synchronize end"]


class _Observed(StepCostModel):
    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def observe(self, shape, seconds: float) -> None:
        self.seconds.append(seconds)
        super().observe(shape, seconds)


def test_calibration_fits_the_runners_device_time_not_the_host_clock():
    class DeviceTimedRunner:  # returns at once, as a CUDA runner's launches do; the device took 40 ms + 1 ms/token
        def execute(self, sched):
            return RunnerOutput(seconds=0.04 + 1e-3 * sched.shape().num_tokens)

    model = _Observed()
    calibrate(DeviceTimedRunner(), model, max_tokens=256)
    assert model.seconds == pytest.approx([0.041, 0.056, 0.104, 0.296, 0.296])


@pytest.mark.slow
def test_the_engine_gives_the_cost_model_the_runners_step_time():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    model = CausalLM(cfg).eval()
    tokenizer = type("Tok", (), {"eos_token_id": 63, "decode": lambda self, ids, **kw: " ".join(map(str, ids))})()
    engine = Engine(EngineConfig(model=ModelConfig(name="tiny", device="cpu"),
                                 cache=CacheConfig(block_size=4, num_blocks=64),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=32, cost_budget=True)),
                    model, tokenizer)
    observed = _Observed()
    engine.scheduler.cost_model = observed
    execute = engine.runner.execute
    reported: list[float] = []

    def device_timed(sched):
        out = execute(sched)
        out.seconds = 0.5 + len(reported)  # far from the host's few milliseconds
        reported.append(out.seconds)
        return out

    engine.runner.execute = device_timed
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert reported and observed.seconds == reported
