"""`make demo`'s steps as the Makefile has them: its held-out sentences follow the rule its comment states, against
the corpus and vocabulary its own target builds; its last lines say what they show; and (slow) the demo runs.

The tests run the Makefile's targets (`make demo-vocab`, `make demo-run`) into a temporary DEMO, so that the
commands tested are the demo's and cannot drift from it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

MASKED = re.compile(r"\[MASK:([^\]]+)\]")


def makefile_variable(name: str) -> str:
    """A variable's value in the Makefile, continuation lines joined."""
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    [value] = re.findall(rf"^{name} \??= (.*)$", makefile, re.MULTILINE)
    return value


def held_out() -> list[str]:
    """HELD_OUT as the shell hands it to examples/fill_mask.py: one argument per sentence."""
    return shlex.split(makefile_variable("HELD_OUT"))


def run_make(target: str, demo_dir, timeout: float) -> str:
    """`make TARGET` with DEMO in `demo_dir` and this interpreter's venv; its stdout (stderr on failure).
    The job runs as a user's would: without the suite's XLA_FLAGS (8 host devices, cheaper compile)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "BERTJAX_TEST_DEVICES")}
    result = subprocess.run(["make", "--no-print-directory", target, f"DEMO={demo_dir}",
                             f"BIN={os.path.dirname(sys.executable)}"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def demo_vocab(tmp_path_factory):
    """(eval.txt's documents as lists of sentences, train.txt's text, a tokenizer of the demo vocabulary, the
    target's output)."""
    transformers = pytest.importorskip("transformers")
    demo = tmp_path_factory.mktemp("demo")
    out = run_make("demo-vocab", demo, timeout=900)
    documents = [d.splitlines() for d in (demo / "corpus" / "eval.txt").read_text(encoding="utf-8").split("\n\n")]
    tokenizer = transformers.BertTokenizerFast(vocab=str(demo / "vocab" / "vocab.txt"), do_lower_case=True)
    return documents, (demo / "corpus" / "train.txt").read_text(encoding="utf-8"), tokenizer, out


def whole_token_words(sentence: str, tokenizer) -> list[str]:
    """The sentence's alphabetic words that the vocabulary holds as one token, in order."""
    pieces = tokenizer.tokenize(sentence)
    return [piece for piece, after in zip(pieces, pieces[1:] + [""])
            if piece.isalpha() and not after.startswith("##")]


def by_the_rule(documents: list[list[str]], tokenizer) -> list[str]:
    """The Makefile comment's rule: in each of the first five held-out topics, its first sentence of 5 to 12 words,
    masking its longest word that is one token of the vocabulary (the first of equal length)."""
    chosen = []
    for sentences in documents[:5]:
        sentence = next(s for s in sentences if 5 <= len(s.split()) <= 12)
        word = max(whole_token_words(sentence, tokenizer), key=len)  # max keeps the first of equal length
        chosen.append(re.sub(rf"\b({word})\b", r"[MASK:\1]", sentence, count=1, flags=re.IGNORECASE))
    return chosen


def test_held_out_sentences_are_the_rules_choice(demo_vocab):
    documents, _, tokenizer, _ = demo_vocab
    assert held_out() == by_the_rule(documents, tokenizer)


def test_each_held_out_word_is_one_token_seen_in_the_training_topics(demo_vocab):
    """fill_mask.py compares one token: a word the vocabulary splits (`assign ##ed`) could never be guessed; and a
    word the training topics never hold could not be learned."""
    documents, train, tokenizer, _ = demo_vocab
    held_out_text = "\n".join(s for sentences in documents for s in sentences)
    for sentence in held_out():
        [word] = MASKED.findall(sentence)
        assert MASKED.sub(r"\1", sentence) in held_out_text.splitlines()  # a sentence of the held-out topics
        assert tokenizer.tokenize(word) == [word.lower()], word
        assert len(re.findall(rf"\b{word}\b", train, re.IGNORECASE)) >= 10, word


def test_vocabulary_says_why_it_is_smaller_than_asked(demo_vocab):
    """The Makefile comment's account: the corpus holds fewer pieces seen 10 times than --vocab-size asks."""
    _, _, tokenizer, out = demo_vocab
    assert f"vocab.txt: {len(tokenizer.vocab)} tokens of the 4000 asked: limited by --min-count 10" in out, out
    assert 700 < len(tokenizer.vocab) < 1000


def test_rule_reads_words_as_the_vocabulary_does(tmp_path):
    """A hand-made vocabulary: 'assigned' split into pieces is no candidate, nor is punctuation; the longest whole
    word wins, the first of equal length; a sentence outside 5 to 12 words is passed over."""
    transformers = pytest.importorskip("transformers")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "module", "attributes", "can",
                                "be", "assign", "##ed", "to", "values"]) + "\n", encoding="utf-8")
    tokenizer = transformers.BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    assert whole_token_words("Module attributes can be assigned to.", tokenizer) == [
        "module", "attributes", "can", "be", "to"]
    documents = [["Module attributes.", "Module attributes can be assigned to values."],
                 ["Module values can be assigned to."]] * 3
    assert by_the_rule(documents, tokenizer) == ["Module [MASK:attributes] can be assigned to values.",
                                                 "[MASK:Module] values can be assigned to."] * 2 + [
                                                     "Module [MASK:attributes] can be assigned to values."]


def _fill_mask_example():
    spec = importlib.util.spec_from_file_location("fill_mask", REPO_ROOT / "examples" / "fill_mask.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demos_last_lines_say_what_the_count_means_and_how_long_pretraining_took(tmp_path):
    """The count of held-out words in the top 5 is said in words, then the pretraining's wall time (its runs'
    goodput records: a resumed run's two add up) and its last held-out evaluation beside the baseline."""
    records = [{"step": 0, "eval_mlm_accuracy": 0.05, "eval_most_frequent_token_accuracy": 0.0627},
               {"step": 4000, "event": "goodput", "wall_s": 300.4},
               {"step": 6000, "eval_mlm_accuracy": 0.41934, "eval_most_frequent_token_accuracy": 0.0627},
               {"step": 6000, "event": "goodput", "wall_s": 125.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = _fill_mask_example().closing_lines(2, 5, str(tmp_path))
    assert lines == [
        "held-out words in the top 5: 2 of 5",
        "  = of 5 words masked in sentences the model never trained on (topics held out of its corpus), 2 were "
        "among its 5 likeliest guesses for the gap",
        f"pretraining: 6000 steps in 7m06s over 2 runs ({tmp_path})",
        "  held-out MLM accuracy 0.4193 at step 6000 (always guessing the most frequent masked token: 0.0627)"]
    assert _fill_mask_example().closing_lines(1, 5)[1].startswith("  = of 5 words masked in sentences the model "
                                                                   "never trained on")


@pytest.mark.slow
def test_the_demo_runs_and_says_what_it_showed(tmp_path):
    """The whole demo after the install: pretraining, export, and transformers' fill-mask on HELD_OUT, ending with
    what its count means and how long the pretraining took. (How many words it finds is no test: the embedded
    corpus bounds it, 2 of 5 on 2026-11-28, docs/performance-history.md.)"""
    out = run_make("demo-run", tmp_path / "demo", timeout=3600)
    [(found, scored)] = re.findall(r"^held-out words in the top 5: (\d+) of (\d+)$", out, re.MULTILINE)
    assert int(scored) == 5
    assert f"  = of 5 words masked in sentences the model never trained on (topics held out of its corpus), {found} " \
        in out, out[-2500:]
    assert re.search(rf"^pretraining: 6000 steps in \S+ \({tmp_path / 'demo' / 'pretrain'}\)$", out, re.MULTILINE), \
        out[-2500:]
