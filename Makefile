# Tritium: `make serve` and `make test` work from a fresh clone (they install what they need).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed
MODEL_REPOSITORY ?= model_repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
# The slowest tests are listed at the end, so that a slower suite shows where its time went.
PYTEST_ARGS ?= --timeout=600 --durations=15

.PHONY: venv model tool-model serve test test-long perf-analyzer clean

# The environment: the product installed in place (`pip install -e .`: its pins in requirements*.txt,
# read by pyproject.toml) with what the tests need; reinstalled when any of those files changes.
venv: $(STAMP)
$(STAMP): pyproject.toml setup.py requirements.txt requirements-test.txt requirements-nixl.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	touch $@

# The embedded default model: a tiny random-weight Llama, built offline when missing.
model: models/tiny-llama/config.json models/tiny-llama/chat_template.jinja
models/tiny-llama/config.json: | $(STAMP)
	$(PY) scripts/build_default_model.py --out models/tiny-llama
# Its chat template (a model built before the template existed gets it added).
models/tiny-llama/chat_template.jinja: models/tiny-llama/config.json scripts/build_default_model.py
	$(PY) scripts/build_default_model.py --out models/tiny-llama
	touch $@

# Tiny Llamas trained here (seconds, on the CPU) on one tool-using conversation, in the Hermes and
# the Llama 3.1 chat formats: the tool-calling tests serve them. Rebuilt when their scripts change.
TOOL_MODEL_SOURCES := scripts/build_tool_model.py scripts/tool_chat_formats.py scripts/data/corpus.txt
tool-model: models/tiny-tool-llama/config.json models/tiny-tool-llama3/config.json
models/tiny-tool-llama/config.json: $(TOOL_MODEL_SOURCES) | $(STAMP)
	$(PY) -m scripts.build_tool_model --format hermes --force
models/tiny-tool-llama3/config.json: $(TOOL_MODEL_SOURCES) | $(STAMP)
	$(PY) -m scripts.build_tool_model --format llama3_json --force

# perf_analyzer from the tritonclient wheel, with the libraries it needs, in .perf_analyzer/.
perf-analyzer: .perf_analyzer/perf_analyzer
.perf_analyzer/perf_analyzer: scripts/install_perf_analyzer.sh | $(STAMP)
	scripts/install_perf_analyzer.sh

# `tritium serve` on the repository: it prints the URLs once the model is ready, and Ctrl-C stops
# both processes. Relative `model` paths in its config.pbtxt are the checkout's (TRITIUM_ROOT).
serve: venv model
	@echo "Starting tritonserver with $(MODEL_REPOSITORY)/ (model 'llm') and, beside it, the"
	@echo "OpenAI-compatible frontend on port $(OPENAI_PORT) (tritium serve; Ctrl-C stops both)."
	@echo "Once the model is ready, from another shell:"
	@echo "  curl -s localhost:$(OPENAI_PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"llm\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 16}'"
	@echo "  (or the openai package: OpenAI(api_key=\"none\", base_url=\"http://localhost:$(OPENAI_PORT)/v1\"))"
	@echo "  $(PY) -m client --url localhost:$(GRPC_PORT) \"The capital of France is\""
	@echo "  curl -s localhost:$(HTTP_PORT)/v2/models/llm/generate -d '{\"text_input\": \"Hello\", \"max_tokens\": 16}'"
	@echo "  curl -s localhost:$(METRICS_PORT)/metrics | grep vllm:"
	@echo "(The default model has random weights: its output is not meaningful text.)"
	TRITIUM_ROOT=$(CURDIR) TRITIUM_CACHE_DIR=$(CURDIR)/.tritonserver $(PY) -m tritium.cli serve \
		--model-repository $(MODEL_REPOSITORY) --port $(OPENAI_PORT) --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

# The suite without its long runs (pytest.ini leaves out tests marked `long`); CI runs this.
# It compiles into an empty Triton kernel cache, removed afterwards, as on a new user's machine:
# a cache that earlier runs filled once hid compile tests that a new machine could not finish.
test: venv model tool-model perf-analyzer
	@cache=$$(mktemp -d -t tritium-triton-cache.XXXXXX); trap 'rm -rf "$$cache"' EXIT; \
	echo "TRITON_CACHE_DIR=$$cache (empty)"; \
	TRITON_CACHE_DIR="$$cache" $(PY) -m pytest tests/ $(PYTEST_ARGS)

# The long soak, reload and unload-stress runs only (about 8 minutes on 2 cores).
test-long: venv model
	$(PY) -m pytest tests/ -m long $(PYTEST_ARGS)

clean:
	rm -rf .tritonserver .perf_analyzer .pytest_cache
