"""Vocabulary training with BERT's special tokens: SentencePiece (sentencepiece library), WordPiece (tensorflow-text's
vocab learner) or a byte-level BPE as ModernBERT's (HF tokenizers' trainer). Training text is the sentence stream of
any corpus source."""
from __future__ import annotations

import os
from typing import Iterator, NamedTuple

import tensorflow as tf

from bertjax.data import corpus, format_detect
from bertjax.data import out_dir as out_dir_lib
from bertjax.data import tokenizer_json
from bertjax.data.tokenizers import SPECIAL_TOKENS
from bertjax.runtime.errors import OutputWriteError, cannot_write

VOCAB_TYPES = ("sentencepiece", "wordpiece", "bpe")
# [PAD] first so that pad id 0 matches BERT's convention; the rest in the released vocab order.
RESERVED = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
assert set(RESERVED) == set(SPECIAL_TOKENS.values())
# tensorflow-text's WordPiece learner keeps only pieces seen at least this often (its `lower_thresh`, the default
# of `vocab train --min-count`), so that a vocabulary smaller than asked can say which setting limited it.
WORDPIECE_MIN_COUNT = 10
# A BPE merges pairs seen at least this often (HF's ByteLevelBPETokenizer's default min_frequency).
BPE_MIN_COUNT = 2
# A BPE's size is rounded up to a multiple of this with [unused0].. tokens, as ModernBERT's (50,368 = 787 x 64, chosen
# for GPUs' matrix tiles): the embedding table's rows are then a multiple of 64 too.
BPE_SIZE_MULTIPLE = 64


class TrainedVocab(NamedTuple):
    """A written vocabulary: its path, the size reached, why it is smaller than asked (empty when it is not), and how
    many of its tokens are [unused] ones that round its size up."""
    path: str
    size: int
    short_because: str
    unused: int = 0


def corpus_sentences(config: corpus.CorpusConfig, max_sentences: int | None = None) -> tf.data.Dataset:
    """Every sentence of the corpus (a flat tf.string stream), capped at max_sentences."""
    formats = corpus.file_formats(config)
    docs = corpus.documents_from_files(list(formats), config, formats=formats)
    sentences = docs.flat_map(lambda d: tf.data.Dataset.from_tensor_slices(d["sentences"]))
    return sentences.take(max_sentences) if max_sentences else sentences


def train_sentencepiece(sentences: Iterator[str], out_dir: str, vocab_size: int, *, lower_case: bool = False,
                        model_type: str = "unigram", character_coverage: float = 0.9999) -> TrainedVocab:
    """Train `out_dir/spm.model` whose ids 0..4 are [PAD] [UNK] [CLS] [SEP] [MASK]."""
    import sentencepiece as spm

    tf.io.gfile.makedirs(out_dir)
    prefix = os.path.join(out_dir, "spm")
    if lower_case:
        sentences = (s.lower() for s in sentences)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=prefix, vocab_size=vocab_size, model_type=model_type,
        character_coverage=character_coverage, pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
        pad_piece="[PAD]", unk_piece="[UNK]", user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"],
        hard_vocab_limit=False, minloglevel=2)
    size = spm.SentencePieceProcessor(model_file=prefix + ".model").get_piece_size()
    return TrainedVocab(prefix + ".model", size, "" if size >= vocab_size else
                        "SentencePiece found no more pieces worth keeping in the sentences read "
                        "(its vocab limit is soft): a larger corpus gives more")


def train_wordpiece(sentences: tf.data.Dataset, out_dir: str, vocab_size: int, *,
                    lower_case: bool = True, min_count: int = WORDPIECE_MIN_COUNT) -> TrainedVocab:
    """Train `out_dir/vocab.txt` (BERT layout: reserved tokens first) from pieces seen at least `min_count`
    times."""
    if min_count < 1:
        raise ValueError(f"--min-count {min_count}: expected a count >= 1")
    from tensorflow_text.tools.wordpiece_vocab import bert_vocab_from_dataset

    tf.io.gfile.makedirs(out_dir)
    vocab = bert_vocab_from_dataset.bert_vocab_from_dataset(
        sentences.batch(1024).prefetch(2), vocab_size=vocab_size, reserved_tokens=RESERVED,
        bert_tokenizer_params={"lower_case": lower_case}, learn_params={"lower_thresh": min_count})
    path = os.path.join(out_dir, "vocab.txt")
    _write_whole(path, "".join(token + "\n" for token in vocab))
    return TrainedVocab(path, len(vocab), "" if len(vocab) >= vocab_size else
                        f"limited by --min-count {min_count}: the corpus has no more word pieces seen at least "
                        f"{min_count} times in the sentences read (a lower --min-count or a larger corpus gives "
                        f"more)")


def train_bpe(sentences: Iterator[str], out_dir: str, vocab_size: int, *, lower_case: bool = False,
              min_count: int = BPE_MIN_COUNT) -> TrainedVocab:
    """Train `out_dir/tokenizer.json`, a byte-level BPE as ModernBERT's (OLMo's: NFC, GPT-2's byte-level
    pre-tokeniser and decoder; lower-cased too where asked) with BERT's special tokens as ids 0..4 and template, of at
    most `vocab_size` tokens learned from pairs seen at least `min_count` times, then [unused0].. tokens up to a
    multiple of 64; and the tokenizer_config.json and special_tokens_map.json that AutoTokenizer reads beside it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())  # no unknown piece: every byte has one
    tokenizer.normalizer = (normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()]) if lower_case
                            else normalizers.NFC())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    special = [tokenizer_json.special_token(token) for token in RESERVED]  # ids 0..4, as the other types'
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_count, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(sentences, trainer)
    learned = tokenizer.get_vocab_size(with_added_tokens=True)
    unused = -learned % BPE_SIZE_MULTIPLE
    tokenizer.add_special_tokens([tokenizer_json.special_token(f"[unused{i}]") for i in range(unused)])
    tokenizer_json.set_bert_template(tokenizer, SPECIAL_TOKENS)
    tf.io.gfile.makedirs(out_dir)
    files = tokenizer_json.tokenizer_files(tokenizer.to_str(), SPECIAL_TOKENS,
                                           tokenizer_class=tokenizer_json.JSON_CLASS,
                                           model_input_names=["input_ids", "attention_mask"])
    for name, text in files[::-1]:  # tokenizer.json last: the file a run names
        _write_whole(os.path.join(out_dir, name), text)
    return TrainedVocab(os.path.join(out_dir, "tokenizer.json"), learned + unused, "" if learned >= vocab_size else
                        f"limited by --min-count {min_count}: the corpus has no more pairs of pieces seen at least "
                        f"{min_count} times in the sentences read (a lower --min-count or a larger corpus gives more)",
                        unused)


def _write_whole(path: str, text: str) -> None:
    """`text` to `path` under a temporary name first, renamed when whole."""
    try:
        with tf.io.gfile.GFile(path + ".tmp", "w") as f:
            f.write(text)
        tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
    except (tf.errors.OpError, OSError) as error:
        raise OutputWriteError(cannot_write(path, error)) from None


def written_files(out_dir: str, vocab_type: str) -> list[str]:
    """The files `vocab train` writes to `out_dir` (the vocabulary last, under a temporary name first)."""
    if vocab_type == "sentencepiece":
        return [os.path.join(out_dir, "spm.vocab"), os.path.join(out_dir, "spm.model")]
    names = ["vocab.txt"] if vocab_type == "wordpiece" else ["special_tokens_map.json", "tokenizer_config.json",
                                                              "tokenizer.json"]
    return [os.path.join(out_dir, name + tmp) for name in names for tmp in (".tmp", "")]


def train_vocab(config: corpus.CorpusConfig, out_dir: str, vocab_size: int, vocab_type: str, *,
                lower_case: bool | None = None, max_sentences: int | None = 5_000_000,
                min_count: int | None = None, log=print) -> TrainedVocab:
    """Train a vocabulary of `vocab_type` (at most `vocab_size` tokens; a BPE's rounded up to a multiple of 64) on the
    corpus (its format resolved first: format_detect.resolve), holding `out_dir` (out_dir.py); an existing
    vocabulary there is refused, never replaced (one a model was trained with would no longer match it), and a
    failed run removes what it wrote. `lower_case` left out: WordPiece's true, the others' false; `min_count` left
    out: WordPiece's 10, BPE's 2 (SentencePiece has none)."""
    if vocab_type not in VOCAB_TYPES:
        raise ValueError(f"--type {vocab_type!r}: expected one of {', '.join(VOCAB_TYPES)}")
    if vocab_size <= len(RESERVED):
        raise ValueError(f"--vocab-size {vocab_size} leaves no room beside the {len(RESERVED)} special tokens")
    files = written_files(out_dir, vocab_type)
    with out_dir_lib.owned(out_dir, log):
        existing = [path for path in files if not path.endswith(".tmp") and tf.io.gfile.exists(path)]
        if existing:
            raise ValueError(f"{existing[-1]} already exists: vocab train does not replace a vocabulary; remove it, "
                             "or choose another --out")
        try:
            sentences = corpus_sentences(format_detect.resolve(config, log), max_sentences)
            texts = (s.decode("utf-8") for s in sentences.as_numpy_iterator())
            if vocab_type == "sentencepiece":
                return train_sentencepiece(texts, out_dir, vocab_size, lower_case=bool(lower_case))
            if vocab_type == "bpe":
                return train_bpe(texts, out_dir, vocab_size, lower_case=bool(lower_case),
                                 min_count=BPE_MIN_COUNT if min_count is None else min_count)
            return train_wordpiece(sentences, out_dir, vocab_size,
                                   lower_case=True if lower_case is None else lower_case,
                                   min_count=WORDPIECE_MIN_COUNT if min_count is None else min_count)
        except BaseException:
            out_dir_lib.remove_quietly(*files)
            raise
