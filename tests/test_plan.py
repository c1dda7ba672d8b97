"""The execution plan (engine/executor/plan.py): what each part of a step runs, as the loaded engine takes it.

- The default model's plan on this CPU, and under the AVX2 reading (`make test` runs the `isa` tests again under
  ORTHRUS_CPU_ISA=avx2), is the one its instruction set implies.
- Each implementation this machine can run is exercised: an engine built to take it names it in its plan and
  generates the same greedy tokens and embeddings as the engine on torch's own ops alone.
- The plan is printed by `orthrus-rag plan`, written into a run folder and served in `/v1/models`' card."""

from __future__ import annotations

import json

import pytest
import torch

from orthrus_rag import PoolingParams, SamplingParams
from orthrus_rag.engine.executor.plan import ExecutionPlan, cpu_isa
from orthrus_rag.layers.attention.cpu_prefill import amx_body, prefill_kernel_runs
from orthrus_rag.layers.cpu_extension import kernels
from tests.gpu_support import ids, save_random_model, smol_config

pytestmark = pytest.mark.slow

# every C++ body off: the reference each kernel cell is compared with
TORCH_ONLY = {"cpu_fused_kernels": False, "cpu_layer_loop": False, "cpu_decode_kernel": False,
              "cpu_prefill_kernel": False, "cpu_sample_kernel": False, "linear_kernel": "dense"}


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
    assert plan.cell("layers").choice.startswith("C++ layer loop")
    assert plan.cell("sampler").choice == "C++ draw and argmax"
    assert plan.cell("linears").choice.startswith("layers ")
    decode, prefill, encoder = (plan.cell(p) for p in ("decode attention", "prefill attention", "encoder attention"))
    if native_bf16:
        assert decode == decode.__class__("decode attention", "C++ kernel, AVX512-BF16 body", "avx512_bf16")
        if isa == "amx" and not amx_body():  # a compiler or OS without AMX tiles: SDPA, which runs on them
            assert prefill.choice.startswith("SDPA; the C++ kernel in steps of chunks")
        else:
            assert prefill.choice == f"C++ kernel, {_expected_bf16_attention()}"
            assert encoder.choice == prefill.choice
    else:
        width = "AVX-512" if isa == "avx512" else "AVX2"
        assert decode.choice == "C++ kernel, generic body" and not decode.needs
        assert prefill.choice == f"C++ kernel, fp32 body ({width} width)" and not prefill.needs
        assert encoder.choice == f"C++ kernel, fp32 body ({width} width)"
    assert "amx" not in plan.summary() or isa == "amx"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer model of SmolLM2's shape (head size 64, 9 / 3 heads: the decode kernel's bf16 body covers it)."""
    return save_random_model(smol_config(num_layers=2), tmp_path_factory.mktemp("plan_tiny"))


def _engine(folder, **options):
    from orthrus_rag import Engine
    from orthrus_rag.config.build import engine_config

    base = {"num_blocks": 256, "max_num_batched_tokens": 64, "max_chunk_tokens": 32, "dtype": "float32"}
    return Engine.from_config(engine_config(str(folder), **{**base, **options}))


def _outputs(eng) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of prompts that take several chunks, and mean-pooled embeddings on the backbone."""
    prompts = [ids(n, seed) for seed, n in enumerate((5, 40, 90))]
    gens = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    embs = eng.embed([ids(70, 9), ids(12, 10)], PoolingParams(pooling="mean"))
    return [g.token_ids for g in gens], torch.stack([e.embedding for e in embs])


# (what an engine is built with, the cells its plan must show); fp32 runs on every x86-64 CPU
CELLS = [
    ({}, {"layers": "C++ layer loop", "decode attention": "C++ kernel, generic body",
          "prefill attention": "C++ kernel, fp32 body", "sampler": "C++ draw and argmax"}),
    ({"cpu_layer_loop": False}, {"layers": "Python loop of the fused C++ kernels"}),
    ({"cpu_decode_kernel": False, "cpu_prefill_kernel": False},
     {"decode attention": "SDPA over padded groups", "prefill attention": "SDPA over padded groups"}),
    ({"linear_kernel": "onednn"}, {"linears": "layers oneDNN from 1 row, LM head oneDNN from 1 row"}),
    ({"linear_kernel": "dense", "cpu_sample_kernel": False}, {"linears": "layers dense, LM head dense",
                                                              "sampler": "torch"}),
    (TORCH_ONLY, {"layers": "Python loop of torch ops"}),
]


@pytest.mark.parametrize("options,cells", CELLS, ids=[",".join(o) or "defaults" for o, _ in CELLS])
def test_each_cell_names_what_runs_and_computes_what_torch_computes(tiny, options, cells):
    if kernels() is None:
        pytest.fail("the CPU kernels did not build (a C++ compiler and ninja are installed by make test)")
    reference = _outputs(_engine(tiny, **TORCH_ONLY))
    eng = _engine(tiny, **options)
    for part, choice in cells.items():
        assert eng.plan.cell(part).choice.startswith(choice), eng.plan
    tokens, vectors = _outputs(eng)
    assert tokens == reference[0]
    assert torch.allclose(vectors, reference[1], atol=1e-4, rtol=1e-4)


@pytest.mark.isa
def test_the_bf16_bodies_this_cpu_has_are_planned_and_match_torch(tiny):
    """bf16 where the CPU builds its bodies: the decode kernel's AVX512-BF16 body and the prefill kernel's
    AVX512-BF16 or AMX body, named in the plan; the embeddings close to torch's ops in bf16."""
    if not prefill_kernel_runs(torch.bfloat16, 64):
        plan = _engine(tiny, dtype="bfloat16", linear_kernel="dense").plan
        assert "AVX512-BF16" not in plan.summary() and "AMX" not in plan.summary()
        return
    eng = _engine(tiny, dtype="bfloat16")
    assert eng.plan.cell("decode attention").choice == "C++ kernel, AVX512-BF16 body"
    assert eng.plan.cell("prefill attention").choice == f"C++ kernel, {_expected_bf16_attention()}"
    reference = _engine(tiny, dtype="bfloat16", **{k: v for k, v in TORCH_ONLY.items() if k != "linear_kernel"})
    _, vectors = _outputs(eng)
    _, expected = _outputs(reference)
    assert torch.nn.functional.cosine_similarity(vectors.float(), expected.float()).min() > 0.999


def test_the_plan_is_one_line_and_json(tiny):
    plan = _engine(tiny).plan
    assert isinstance(plan, ExecutionPlan) and "\n" not in plan.summary()
    data = json.loads(plan.dumps())
    assert data["device"] == "cpu" and set(data["cells"]) >= {"layers", "linears", "decode attention",
                                                              "prefill attention", "sampler"}
    with pytest.raises(KeyError, match="no plan cell 'LoRA'"):
        plan.cell("LoRA")


def test_the_cli_prints_the_plan(capsys):
    from orthrus_rag.entrypoints.cli import main

    assert main(["plan", "model.embedding_model=null", "cache.num_blocks=64", "model.dtype=float32"]) == 0
    out = capsys.readouterr().out
    assert "layers" in out and "decode attention" in out and "sampler" in out


def test_the_server_shows_the_plan_in_the_base_models_card(served):
    import httpx

    cards = httpx.get(f"{served.url}/models", timeout=30).json()["data"]
    base = next(c for c in cards if c["id"] == served.model)
    assert base["plan"] == served.aengine.plan.to_json() and "layers" in base["plan"]["cells"]
    assert all(c["plan"] is None for c in cards if c is not base)
