"""The execution plan (engine/executor/plan.py): what each part of a step runs, as the loaded engine takes it.

- The default model's plan on this CPU, and under the AVX2 reading (`make test` runs the `isa` tests again under
  ORTHRUS_CPU_ISA=avx2), is the one its instruction set implies.
- Each implementation this machine can run is exercised (a test checks that the list is whole): an engine built to
  take it names it in its plan and generates the same greedy tokens and embeddings as the engine on torch's ops.
- The plan is printed by `orthrus-rag plan`, written into a run folder and served in `/v1/models`' card."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from orthrus_rag import PoolingParams, SamplingParams
from orthrus_rag.config.kernels import PARTS
from orthrus_rag.engine.executor.plan import ExecutionPlan, choose_layers, choose_lora, cpu_isa
from orthrus_rag.layers.attention.cpu_prefill import amx_body, prefill_kernel_available, prefill_kernel_runs
from orthrus_rag.layers.cpu_extension import kernels
from orthrus_rag.layers.linear import onednn_available
from tests.gpu_support import ids, save_random_model, smol_config

pytestmark = pytest.mark.slow


def _expected_bf16_attention() -> str:
    return "AMX body" if amx_body() else "AVX512-BF16 body"


@pytest.mark.isa
def test_the_default_models_plan_follows_this_cpus_instruction_set():
    """SmolLM2 with MiniLM at the defaults (dtype auto): bf16 where the CPU has bf16 dot products, fp32 elsewhere,
    and each attention body the one its ISA builds (read as AVX2-only in make test's second pass)."""
    from orthrus_rag import Engine

    plan = Engine.from_pretrained("smollm2-135m-instruct", embedding_model="all-minilm-l6-v2", num_blocks=64).plan
    isa = cpu_isa()
    assert plan.isa == isa and plan.device == "cpu"
    native_bf16 = isa in ("amx", "avx512_bf16")
    assert plan.dtype == ("bfloat16" if native_bf16 else "float32")
    assert plan.cell("layers").choice == "split"
    assert plan.cell("layers").body.startswith("C++ layer loop")
    assert str(plan.cell("sampler")) == "sampler: cpp (C++ draw and argmax)"
    assert plan.cell("linears").body.startswith("layers ")
    decode, prefill, encoder = (plan.cell(p) for p in ("decode_attention", "prefill_attention", "encoder_attention"))
    if native_bf16:
        assert decode == decode.__class__("decode_attention", "cpp", "AVX512-BF16 body", "avx512_bf16")
        if not prefill_kernel_available(torch.bfloat16, 64):  # AMX without the kernel's AMX body: SDPA, on tiles
            assert prefill.choice == "sdpa" and encoder.choice == "sdpa"
        else:
            assert (prefill.choice, prefill.body) == ("cpp", _expected_bf16_attention())
            assert (encoder.choice, encoder.body) == ("cpp", _expected_bf16_attention())
    else:
        width = "AVX-512" if isa == "avx512" else "AVX2"
        assert (decode.choice, decode.body, decode.needs) == ("cpp", "generic body", "")
        assert (prefill.choice, prefill.body, prefill.needs) == ("cpp", f"fp32 body, {width} width", "")
        assert (encoder.choice, encoder.body) == ("cpp", f"fp32 body, {width} width")
    assert "amx" not in plan.summary() or isa == "amx"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer model of SmolLM2's shape (head size 64, 9 / 3 heads: the decode kernel's bf16 body covers it) and
    two PEFT LoRA adapters of it, on every projection."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    folder = save_random_model(smol_config(num_layers=2), tmp_path_factory.mktemp("plan_tiny"))
    adapters = {}
    for seed, name in ((3, "a"), (4, "b")):
        torch.manual_seed(seed)
        peft = get_peft_model(LlamaForCausalLM.from_pretrained(str(folder)), LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        peft.save_pretrained(str(folder.parent / f"adapter_{name}"))
        adapters[name] = str(folder.parent / f"adapter_{name}")
    return folder, adapters


def _engine(tiny, **options):
    from orthrus_rag import Engine
    from orthrus_rag.config.build import engine_config

    folder, adapters = tiny
    base = {"num_blocks": 256, "max_num_batched_tokens": 64, "max_chunk_tokens": 32, "dtype": "float32"}
    if options.pop("adapters", False):
        base["adapters"] = adapters
    return Engine.from_config(engine_config(str(folder), **{**base, **options}))


def _outputs(eng) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of prompts that take several chunks (under each adapter the engine has, in one step), and
    mean-pooled embeddings (the encoder's, where there is one, and the backbone's)."""
    prompts = [ids(n, seed) for seed, n in enumerate((5, 40, 90))]
    names = [None, *eng.adapter_slots]
    gens = eng.generate([p for p in prompts for _ in names], [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, adapter=name)
        for _ in prompts for name in names])
    texts = [ids(70, 9), ids(12, 10)]
    embs = eng.embed(texts, PoolingParams(pooling="mean", adapter=""))
    if eng.runner.encoder is not None:
        embs += eng.embed(["a short passage", "another passage, a little longer than the first one"])
    return [g.token_ids for g in gens], torch.cat([e.embedding.flatten() for e in embs])


_REFERENCES: dict[tuple, tuple[list[list[int]], torch.Tensor]] = {}


def _reference(tiny, **same) -> tuple[list[list[int]], torch.Tensor]:
    """The `kernels=torch` engine's outputs, once per set of adapters and encoder (each cell compares with them)."""
    key = (str(tiny[0]), *sorted(same.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _outputs(_engine(tiny, kernels="torch", **same))
    return _REFERENCES[key]


def _split_often(eng) -> None:
    """The column split for every step (its threshold is for speed only; the tests' steps are a few rows)."""
    loop = eng.runner.model.model.layer_loop
    loop.split_from = 1


# (what an engine is built with, the cells its plan must show as (choice, body prefix)); fp32 runs on every
# x86-64 CPU. `adapters` adds two LoRA adapters (to the engine and to its torch reference), `encoder` MiniLM.
CELLS = [
    ({}, {"layers": ("split", "C++ layer loop"), "decode_attention": ("cpp", "generic body"),
          "prefill_attention": ("cpp", "fp32 body"), "sampler": ("cpp", "C++ draw and argmax")}),
    ({"kernel_overrides": {"layers": "loop"}}, {"layers": ("loop", "C++ layer loop")}),
    ({"kernel_overrides": {"layers": "split", "linears": "onednn"}, "split": True},
     {"layers": ("split", "C++ layer loop, column split"), "linears": ("onednn", "layers oneDNN from 1 row")}),
    ({"kernel_overrides": {"layers": "fused"}}, {"layers": ("fused", "Python loop of the fused C++ kernels")}),
    ({"kernel_overrides": {"decode_attention": "sdpa", "prefill_attention": "sdpa"}},
     {"decode_attention": ("sdpa", "padded groups"), "prefill_attention": ("sdpa", "padded groups")}),
    ({"kernel_overrides": {"linears": "onednn"}}, {"linears": ("onednn", "layers oneDNN from 1 row, LM head oneDNN")}),
    ({"kernel_overrides": {"linears": "dense", "sampler": "torch"}},
     {"linears": ("dense", "layers dense, LM head dense"), "sampler": ("torch", "")}),
    ({"kernels": "torch"}, {"layers": ("torch", "Python loop of torch ops"), "decode_linears": ("off", "")}),
    ({"kernel_overrides": {"decode_linears": "off"}}, {"decode_linears": ("off", "")}),
    ({"adapters": True}, {"lora": ("cpp", "one call per projection"), "layers": ("split", "C++ layer loop")}),
    ({"adapters": True, "kernel_overrides": {"lora": "torch"}},
     {"lora": ("torch", "products per adapter"), "layers": ("split", "C++ layer loop; steps with adapter rows")}),
    ({"adapters": True, "kernel_overrides": {"lora": "per_slot", "layers": "fused"}},
     {"lora": ("per_slot", "torch products"), "layers": ("fused", "")}),
    ({"adapters": True, "kernel_overrides": {"lora": "stacked"}}, {"lora": ("stacked", "torch products")}),
    ({"embedding_model": "all-minilm-l6-v2"}, {"encoder_attention": ("cpp", "fp32 body")}),
    ({"embedding_model": "all-minilm-l6-v2", "kernel_overrides": {"encoder_attention": "sdpa"}},
     {"encoder_attention": ("sdpa", "per sequence")}),
]


def _ids(options: dict) -> str:
    return ",".join(f"{k}={v}" if k != "kernel_overrides" else ",".join(f"{p}={c}" for p, c in v.items())
                    for k, v in options.items()) or "defaults"


@pytest.mark.parametrize("options,cells", CELLS, ids=[_ids(o) for o, _ in CELLS])
def test_each_cell_names_what_runs_and_computes_what_torch_computes(tiny, options, cells):
    if kernels() is None:
        pytest.fail("the CPU kernels did not build (a C++ compiler and ninja are installed by make test)")
    options = dict(options)
    split = options.pop("split", False)
    if split and ((os.cpu_count() or 1) < 2 or not onednn_available(torch.float32, "cpu")):
        pytest.fail("the column split needs two cores and oneDNN (make test runs on two cores)")
    same = {k: v for k, v in options.items() if k in ("adapters", "embedding_model")}
    reference = _reference(tiny, **same)
    threads = torch.get_num_threads()
    try:
        # NOTE: two threads for the split (a test worker may compute on one); the engine sets them process-wide
        eng = _engine(tiny, **options, **({"num_threads": 2} if split else {}))
        for part, (choice, body) in cells.items():
            cell = eng.plan.cell(part)
            assert cell.choice == choice and cell.body.startswith(body), eng.plan
        if split:
            _split_often(eng)
        tokens, vectors = _outputs(eng)
    finally:
        torch.set_num_threads(threads)
    if split:
        assert eng.runner.model.model.layer_loop.split_steps > 0
    assert tokens == reference[0]
    assert torch.allclose(vectors, reference[1], atol=1e-4, rtol=1e-4)


def _runnable_here(part: str, choice: str) -> bool:
    """Whether an explicit `part=choice` runs on this machine in fp32 (the CPU's cells; CUDA's are the gpu set's)."""
    from orthrus_rag.engine.executor import plan

    cpu, fp32 = torch.device("cpu"), torch.float32
    try:
        if part == "layers":
            return choose_layers(choice, cpu, fp32) == choice
        if part == "lora":
            return choose_lora(choice, cpu, fp32) == choice
        if part in ("decode_attention", "prefill_attention"):
            from orthrus_rag.layers.attention import grouped

            fn = plan.choose_decode if part == "decode_attention" else plan.choose_prefill
            args = (choice, cpu, fp32, grouped) if part == "decode_attention" else (choice, cpu, fp32, 64, grouped)
            return fn(*args) == choice
        if part == "encoder_attention":
            return plan.choose_encoder(choice, cpu, fp32, 32) == choice
        if part == "sampler":
            return plan.choose_sampler(choice, cpu) == choice
        if part == "linears":
            return plan.choose_linears(choice, cpu, fp32) == choice
        if part == "decode_linears":
            return plan.choose_decode_linears(choice, cpu, fp32) == choice
    except ValueError:
        return False
    return False  # attention backends and CUDA graphs: one choice on the CPU (grouped, off), CUDA's the gpu set's


def test_every_cell_this_machine_runs_is_exercised_above():
    """Each (part, choice) this CPU can run appears in some engine of CELLS whose plan shows it and whose outputs
    equal torch's; the bf16 bodies are test_the_bf16_bodies_..., CUDA's cells tests/test_gpu_*.py."""
    exercised = {(part, choice) for _, cells in CELLS for part, (choice, _) in cells.items()}
    runnable = {(part, choice) for part, choices in PARTS.items() for choice in choices
                if choice != "auto" and _runnable_here(part, choice)}
    assert runnable and runnable <= exercised, sorted(runnable - exercised)


@pytest.mark.isa
def test_the_bf16_bodies_this_cpu_has_are_planned_and_match_torch(tiny):
    """bf16 where the CPU builds its bodies: the decode kernel's AVX512-BF16 body and the prefill kernel's
    AVX512-BF16 or AMX body, named in the plan; the embeddings close to torch's ops in bf16."""
    if not prefill_kernel_runs(torch.bfloat16, 64):
        plan = _engine(tiny, dtype="bfloat16", kernel_overrides={"linears": "dense"}).plan
        assert "AVX512-BF16" not in plan.summary() and "AMX" not in plan.summary()
        return
    eng = _engine(tiny, dtype="bfloat16", kernel_overrides={"prefill_attention": "cpp", "decode_linears": "cpp"})
    assert str(eng.plan.cell("decode_attention")) == "decode_attention: cpp (AVX512-BF16 body)"
    assert str(eng.plan.cell("decode_linears")) == ("decode_linears: cpp (AVX512-BF16 product on dense weights: "
                                                    "layers up to 4 rows, LM head up to 4 rows)")
    assert eng.plan.cell("decode_linears").needs == "avx512_bf16"
    assert str(eng.plan.cell("prefill_attention")) == f"prefill_attention: cpp ({_expected_bf16_attention()})"
    reference = _engine(tiny, dtype="bfloat16", kernels="torch", kernel_overrides={"linears": "auto"})
    _, vectors = _outputs(eng)
    _, expected = _outputs(reference)
    assert torch.nn.functional.cosine_similarity(vectors.float()[None], expected.float()[None]).min() > 0.999


def test_an_explicit_choice_this_machine_cannot_run_is_refused_with_the_reason(tiny):
    with pytest.raises(ValueError, match="decode_linears=cpp cannot run here: it multiplies bf16 weights, not "
                                         "float32; use off or auto"):
        _engine(tiny, kernel_overrides={"decode_linears": "cpp"})
    with pytest.raises(ValueError, match="layers=compiled is the CUDA path"):
        _engine(tiny, kernel_overrides={"layers": "compiled"})
    with pytest.raises(ValueError, match="attention backend 'varlen' cannot run here"):
        _engine(tiny, kernel_overrides={"attention": "varlen"})


def test_the_plan_is_one_line_and_json(tiny):
    plan = _engine(tiny).plan
    assert isinstance(plan, ExecutionPlan) and "\n" not in plan.summary()
    data = json.loads(plan.dumps())
    assert data["device"] == "cpu" and set(data["cells"]) >= {"layers", "linears", "decode_attention",
                                                              "prefill_attention", "sampler"}
    assert data["cells"]["sampler"] == {"choice": "cpp", "body": "C++ draw and argmax"}
    with pytest.raises(KeyError, match="no plan cell 'lora'"):
        plan.cell("lora")


def test_the_cli_prints_the_plan(capsys):
    from orthrus_rag.entrypoints.cli import main

    assert main(["plan", "model.embedding_model=null", "cache.num_blocks=64", "model.dtype=float32",
                 "+model.kernel_overrides.decode_attention=sdpa"]) == 0
    out = capsys.readouterr().out
    assert "layers" in out and re.search(r"^decode_attention +sdpa", out, re.M) and "sampler" in out


def test_the_server_shows_the_plan_in_the_base_models_card(served):
    import httpx

    cards = httpx.get(f"{served.url}/models", timeout=30).json()["data"]
    base = next(c for c in cards if c["id"] == served.model)
    assert base["plan"] == served.aengine.plan.to_json() and "layers" in base["plan"]["cells"]
    assert all(c["plan"] is None for c in cards if c is not base)
