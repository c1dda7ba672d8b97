"""Every benchmark experiment runs end to end from its Hydra config at a tiny scale on the real model and writes
its report: JSON, a markdown table with a row per system and group, and its PNGs. Figures are not asserted
(they are timings); what is asserted is that every request was served and accounted for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # builds engines; tests the benchmark scripts (make test-bench)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "scripts" / "bench" / "conf"
TINY = ["model.name=smollm2-135m-instruct", "workload.words=8", "workload.max_tokens=4",
        "scheduler.max_num_batched_tokens=64", "scheduler.max_chunk_tokens=32", "cache.num_blocks=256",
        "threads.inproc=1", "threads.split=[1,1]"]


def _script():
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark

    return benchmark


@pytest.fixture(scope="module")
def bench_script():
    # NOTE: not named `benchmark`: pytest-benchmark (which langchain-tests brings) owns that fixture name
    return _script()


def compose_bench(experiment: str, tmp_path: Path, *overrides: str):
    _script().register_experiments()  # each experiment module's CONFIG, as the command line registers them
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("bench", overrides=[f"experiment={experiment}", f"out={tmp_path}", *TINY, *overrides])


def test_every_experiment_config_composes(tmp_path):
    names = _script().register_experiments()
    assert names == sorted(p.stem for p in (ROOT / "scripts" / "bench" / "experiments").glob("*.py"))
    assert {"ratio_sweep", "three_phase", "fcfs_blocking", "poisson", "iter_retgen", "chunk_equivalence",
            "rerank_mix"} <= set(names)
    for name in names:
        cfg = compose_bench(name, tmp_path)
        assert cfg.experiment.name == name
        assert Path(cfg.out) == tmp_path


def test_an_experiment_overrides_the_shared_settings_and_the_command_line_overrides_both(tmp_path):
    _script().register_experiments()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        fcfs = compose("bench", overrides=["experiment=fcfs_blocking"])
        chunks = compose("bench", overrides=["experiment=chunk_equivalence", "peers=[hf]"])
    assert fcfs.scheduler.max_num_seqs == 32 and fcfs.workload.spread == 0.0  # the experiment's, not bench.yaml's
    assert fcfs.scheduler.max_num_batched_tokens == 256  # what it does not set stays shared
    assert list(chunks.systems) == []  # the experiment's
    assert list(chunks.peers) == ["hf"]  # the command line's


def test_ratio_sweep_with_a_peer(bench_script, tmp_path):
    cfg = compose_bench("ratio_sweep", tmp_path, "systems=[orthrus,orthrus+slo,hetero-fcfs]", "peers=[hf]",
                        'experiment.ratios=["9:1","1:9"]', "experiment.clients=4", "experiment.duration_s=3", "experiment.warmup_s=0",
                        "++peer_options.hf.cb_num_blocks=64")
    bench_script.run(cfg)
    res = json.loads((tmp_path / "results.json").read_text())
    got = {(r["system"], r["group"]) for r in res["rows"]}
    assert got == {(s, g) for s in ("orthrus", "orthrus+slo", "hetero-fcfs", "hf") for g in ("9:1", "1:9")}
    for r in res["rows"]:
        assert sum(k["completed"] for k in r["kinds"].values()) > 0 and r["unfinished"] == 0
        assert all(k["errors"] == 0 for k in r["kinds"].values())
    for r in res["rows"]:  # the engine's step log is there for in-process systems only
        assert ("steps" in r) == (r["system"] != "hf")
    for r in res["rows"]:  # only the system with targets has them act
        if r["system"] in ("orthrus", "hetero-fcfs"):
            assert r["steps"]["time_capped_frac"] == r["steps"]["generate_at_risk_frac"] == 0
        if r["system"] == "orthrus" and r["group"] == "1:9":
            assert 0 < r["steps"]["itl_p95_s"] <= r["steps"]["itl_max_s"]
    table = (tmp_path / "table.md").read_text()
    assert "× hf" in table and table.count("| 9:1 |") == 4
    for name in ("throughput.png", "latency_cdf_9-1.png", "step_mix_1-9.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_three_phase_accounts_for_every_phase(bench_script, tmp_path):
    cfg = compose_bench("three_phase", tmp_path, "systems=[orthrus,dedicated]", "peers=[]",
                        "experiment.per_phase=10", "experiment.clients=4")
    bench_script.run(cfg)
    res = json.loads((tmp_path / "results.json").read_text())
    for system in ("orthrus", "dedicated"):
        phases = res["phases"][system]
        assert [p["phase"] for p in phases] == [0, 1, 2]
        assert all(p["completed"] == 10 and p["unfinished"] == 0 for p in phases)
    assert res["phases"]["orthrus"][0]["budget_fill"] > 0  # one engine: the step log is there
    assert (tmp_path / "table.md").read_text().count("dedicated") >= 3
    assert (tmp_path / "completions.png").stat().st_size > 0


def test_fcfs_blocking_serves_the_whole_burst(bench_script, tmp_path):
    cfg = compose_bench("fcfs_blocking", tmp_path, "systems=[hetero-fcfs,orthrus]", "peers=[]",
                        "experiment.num_generate=6", "experiment.num_embed=6", "experiment.long_max_tokens=8",
                        "scheduler.max_num_seqs=4", "baseline=hetero-fcfs")
    bench_script.run(cfg)
    res = json.loads((tmp_path / "results.json").read_text())
    for r in res["rows"]:
        assert r["kinds"]["generate"]["completed"] == 6 and r["kinds"]["embed"]["completed"] == 6
        assert r["makespan_s"] > 0
    assert "makespan" in (tmp_path / "table.md").read_text()


def test_poisson_submits_on_schedule_per_rate(bench_script, tmp_path):
    cfg = compose_bench("poisson", tmp_path, "systems=[orthrus]", "peers=[]", "experiment.rates=[2,4]",
                        "experiment.duration_s=2")
    bench_script.run(cfg)
    res = json.loads((tmp_path / "results.json").read_text())
    pts = res["curves"]["orthrus"]
    assert [p["offered_rps"] for p in pts] == [2.0, 4.0]
    assert all(p["submitted"] > 0 and p["unfinished"] == 0 and p["completed"] == p["submitted"] for p in pts)
    for run in res["runs"]["orthrus"].values():  # arrivals inside the window, latency from the scheduled time
        assert all(0 <= r["start_s"] < 2 and r["finish_s"] >= r["start_s"] for r in run["records"])
    assert (tmp_path / "latency_throughput.png").stat().st_size > 0


def test_rerank_mix_scores_in_the_one_loop_and_in_the_pooling_worker(bench_script, tmp_path):
    cfg = compose_bench("rerank_mix", tmp_path, "experiment.clients=4", "experiment.duration_s=3",
                        "experiment.warmup_s=0", "experiment.documents=3", 'experiment.mixes=["4:2:4"]')
    assert list(cfg.systems) == ["orthrus", "dedicated"] and list(cfg.model.rerankers) == ["backbone"]
    bench_script.run(cfg)
    res = json.loads((tmp_path / "results.json").read_text())
    assert {r["system"] for r in res["rows"]} == {"orthrus", "dedicated"}
    for r in res["rows"]:
        assert r["kinds"]["score"]["completed"] > 0 and r["unfinished"] == 0
        assert all(k["errors"] == 0 for k in r["kinds"].values())
    for run in res["runs"].values():
        assert all(rec["num_output_tokens"] == 3 for rec in run["4:2:4"]["records"] if rec["kind"] == "score")
    table = (tmp_path / "table.md").read_text()
    assert "rerank calls/s" in table and table.count("| 4:2:4 |") == 2
    for name in ("rerank_mix.png", "latency_cdf_4-2-4.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_iter_retgen_runs_every_system_through_the_same_app(bench_script, tmp_path):
    cfg = compose_bench("iter_retgen", tmp_path, "experiment.dataset_path=null", "experiment.app_experiment=smoke",
                        "experiment.limit=1", "experiment.policies=[orthrus,dedicated]", "experiment.peers=[hf]",
                        # NOTE: one question, fp32 and one linear kernel: each step then holds the same rows in both
                        # systems (two questions in flight batch by timing, and a GEMM's rows are not bit-equal at
                        # every batch size: a prediction flipped at its first token once on a fresh clone), and
                        # `auto` would time kernels per thread count (2 in process, 1 per worker); in bf16 (the
                        # default where the CPU has it) greedy decoding flips at near-ties
                        'experiment.overrides=["pipeline.max_tokens=8","pipeline.iterations=1","model.dtype=float32",'
                        '"+model.kernel_overrides.linears=dense"]')
    bench_script.run(cfg)
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["policies"]) == {"orthrus", "dedicated", "hf"}
    for s in res["policies"].values():
        assert s["num_questions"] == 1 and s["num_failed"] == 0
    servings = {name: s["config"]["serving"] for name, s in res["policies"].items()}
    assert servings == {"orthrus": "engine (orthrus)", "dedicated": "dedicated (1, 1)", "hf": "hf"}
    assert "engine" in res["policies"]["orthrus"] and "engine" not in res["policies"]["dedicated"]

    def records(system):
        return [json.loads(line) for line in (tmp_path / system / "records.jsonl").read_text().splitlines()]

    # greedy, the same engine: the deployment answers and retrieves exactly as the one engine does
    assert len(records("orthrus")) == len(records("dedicated")) == 1
    for a, b in zip(records("orthrus"), records("dedicated")):
        assert a["prediction"] == b["prediction"]
        assert [r["id"] for r in a["iterations"][0]["retrieved"]] == [r["id"] for r in b["iterations"][0]["retrieved"]]
    # the peer built its own index (sentence-transformers MiniLM): it finds passages too
    assert all(r["iterations"][0]["retrieved"] for r in records("hf"))
    table = (tmp_path / "table.md").read_text()
    assert "q/s × dedicated" in table and "q/s × hf" in table
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines()[2:]}
    assert set(rows) == {"orthrus", "dedicated", "hf"}
    assert rows["dedicated"][2] == "1.00×" and rows["hf"][3] == "1.00×"  # q/s ratios to itself
    assert rows["orthrus"][2].endswith("×") and rows["orthrus"][3].endswith("×")


def test_chunk_equivalence_matches_whole_sequence_pooling(bench_script, tmp_path):
    cfg = compose_bench("chunk_equivalence", tmp_path, "experiment.poolers=[mean,last,all]",
                        "experiment.chunk_sizes=[7,64]", "experiment.num_texts=2", "experiment.words=40",
                        "experiment.short_words=12")
    bench_script.run(cfg)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["pooler"], r["chunk"]) for r in rows} == {(p, c) for p in ("mean", "last", "all") for c in (7, 64)}
    assert all(r["min_cosine"] > 0.9999 for r in rows)
    assert any(r["chunks_per_text"] > 1 for r in rows)


def test_iter_retgen_commands_compose_as_app_configs(bench_script, tmp_path):
    """Each system's `orthrus-rag run` command names the app's keys (scheduler=..., deploy=...): its overrides
    compose and validate in the app's schema (no model is loaded here)."""
    from bench.experiments.iter_retgen import system_command

    from orthrus_rag.entrypoints.checks import validate
    from tests.test_app_config import _compose

    cfg = compose_bench("iter_retgen", tmp_path, "experiment.dataset_path=null", "experiment.app_experiment=smoke",
                        "scheduler.max_num_seqs=12")
    got = {}
    for system in ("orthrus", "hetero-fcfs", "dedicated", "disagg-pd"):
        cmd = system_command(cfg, system, tmp_path / system)
        app_cfg = _compose(*cmd[cmd.index("run") + 1:])
        validate(app_cfg)
        got[system] = (app_cfg.scheduler.policy, app_cfg.deploy.mode, app_cfg.deploy.threads)
        assert (app_cfg.scheduler.max_num_batched_tokens, app_cfg.scheduler.max_num_seqs) == (64, 12)
    assert got == {"orthrus": ("orthrus", "engine", None), "hetero-fcfs": ("hetero-fcfs", "engine", None),
                   "dedicated": ("orthrus", "dedicated", [1, 1]), "disagg-pd": ("orthrus", "disagg-pd", [1, 1])}


def test_iter_retgen_compares_methods_in_one_table(bench_script, tmp_path):
    """experiment.methods: each method runs as `pipeline=<method>` into out/<method>/<system>/, and one
    table holds them all with what each retrieves and generates per question."""
    cfg = compose_bench("iter_retgen", tmp_path, "experiment.dataset_path=null", "experiment.app_experiment=smoke",
                        "experiment.limit=1", "experiment.methods=[standard_rag,ircot]",
                        "experiment.policies=[orthrus]", "experiment.peers=[]",
                        'experiment.overrides=["pipeline.max_tokens=8","pipeline.step_tokens=8",'
                        '"pipeline.max_steps=2"]')
    bench_script.run(cfg)
    res = json.loads((tmp_path / "results.json").read_text())["methods"]
    assert set(res) == {"standard_rag", "ircot"} and all(set(r) == {"orthrus"} for r in res.values())
    assert res["standard_rag"]["orthrus"]["retrievals_per_question"] == 1
    assert res["ircot"]["orthrus"]["retrievals_per_question"] >= 1
    for method in res:
        assert res[method]["orthrus"]["generated_tokens_per_question"] > 0
        assert res[method]["orthrus"]["config"]["pipeline"] == method
        assert (tmp_path / method / "orthrus" / "records.jsonl").is_file()
    rows = [line.split(" | ") for line in (tmp_path / "table.md").read_text().splitlines()[2:]]
    assert [(r[0].lstrip("| "), r[1]) for r in rows] == [("standard_rag", "orthrus"), ("ircot", "orthrus")]
