"""The embedding job (`finetune embedding`): an encoder of either family fine-tuned into a sentence-embedding model on
the user's (anchor, positive[, negative]) pairs, exported as a sentence-transformers directory.

The pairs are read as `finetune classify` reads its files (table_data.read_rows: CSV/TSV/JSON Lines/Parquet, a bad
row named by file:line and column), each text tokenized alone ([CLS] text [SEP], as sentence-transformers'
Transformer module does) into [N, k, L] rows: anchor, positive, then the hard negative where the file has one. The
shared Trainer trains a `SentenceEmbedder` with contrastive.py's ranking loss over the global batch (every anchor
scored against every device's positives and negatives), cached in chunks with --cache-chunk. Writes to the workdir:
metrics.json (the --dev pairs scored as retrieval), the training curve, the model as a bertjax checkpoint
(WORKDIR/checkpoint, an encoder any job's --init reads) and, with --export-hf, WORKDIR/hf: a sentence-transformers
directory (modules.json, the transformer's HF weights and tokenizer, 1_Pooling, 2_Normalize when normalised) that
`SentenceTransformer(dir)` loads.
"""
from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
from etils import epath

from bertjax.finetune import contrastive, retrieval, table_data
from bertjax.finetune.settings import EmbeddingSettings, TrainSettings
from bertjax.finetune.trainer import Trainer, write_fine_tuned
from bertjax.interop.hf import export_hf
from bertjax.interop.load import load_init
from bertjax.model import layer_layout
from bertjax.model.sentence_embedder import SentenceEmbedder
from bertjax.runtime import jsonio
from bertjax.runtime.console import Console, metric_text
from bertjax.runtime.outputs import replaced_when_whole, write_whole

# The sentence-transformers release the export is checked against (tests/test_embedding.py loads it there); the layout
# written is its v2 one (`sentence_transformers.models.*` modules), which every release since reads.
SENTENCE_TRANSFORMERS_VERSION = "6.3.0"


@dataclasses.dataclass(frozen=True)
class PairSpec:
    """Which columns hold the anchor, its positive and (where the file has the column) a hard negative."""
    anchor_column: str = "anchor"
    positive_column: str = "positive"
    negative_column: str = "negative"


def ranking_loss(settings: EmbeddingSettings) -> contrastive.RankingLoss:
    """The loss `settings` ask for."""
    return contrastive.RankingLoss(scale=settings.scale, learned=settings.learned_scale, symmetric=settings.symmetric)


@dataclasses.dataclass
class Pairs:
    """One file's rows: where each came from, and its texts per column (negatives None without the column)."""
    wheres: list[str]
    anchors: list[str]
    positives: list[str]
    negatives: list[str] | None


def read_pairs(path: str, spec: PairSpec) -> Pairs:
    """The (anchor, positive[, negative]) rows of a table file; a missing column, an empty file or a row with an
    empty text is a ValueError naming file, line and column."""
    rows = table_data.read_rows(path, [spec.anchor_column, spec.positive_column], optional=(spec.negative_column,))
    if not rows:
        raise ValueError(f"{path}: no rows")
    has_negative = any(spec.negative_column in row for _, row in rows)
    texts = {column: [table_data.non_blank_text(where, row, column) for where, row in rows]
             for column in (spec.anchor_column, spec.positive_column)
             + ((spec.negative_column,) if has_negative else ())}
    return Pairs([where for where, _ in rows], texts[spec.anchor_column], texts[spec.positive_column],
                 texts.get(spec.negative_column))


def featurize(columns: list[list[str]], tokenizer, max_seq_length: int) -> dict[str, np.ndarray]:
    """input_ids/input_mask/segment_ids [N, k, max_seq_length] int32: row i holds the i-th text of each column,
    each tokenized alone ([CLS] text [SEP], cut to max_seq_length)."""
    encoded = [tokenizer.encode(texts, max_seq_length) for texts in columns]
    return {key: np.stack([np.asarray(e[key], np.int32) for e in encoded], axis=1)
            for key in ("input_ids", "input_mask", "segment_ids")}


# The Trainer's settings of a per-step evaluation or a test split, which this job has not.
UNUSED_SETTINGS = ("eval_every", "early_stopping_patience", "max_eval_examples", "predict_test")


def check_settings(settings: TrainSettings) -> None:
    """The Trainer's options this job cannot take, refused before anything loads."""
    if settings.grad_accum_steps > 1:
        raise ValueError("--grad-accum-steps: the ranking loss scores each anchor against the whole batch, which "
                         "micro-batches would cut; --cache-chunk N trains the same batch in chunks of N rows")
    if settings.metric_for_best:
        raise ValueError(f"--metric-for-best {settings.metric_for_best}: `finetune embedding` scores its --dev pairs "
                         "once, at the end: no evaluation during training to choose by")
    defaults = TrainSettings()
    for name in UNUSED_SETTINGS:  # a flag taken and ignored would say the run did what it did not
        if getattr(settings, name) != getattr(defaults, name):
            raise ValueError(f"--{name.replace('_', '-')}: `finetune embedding` has no use for it (its --dev pairs "
                             "are scored whole, once, at the end; there is no test split)")


class EmbeddingTrainer(Trainer):
    """The Trainer with the ranking loss over the whole (global) batch in place of a per-row loss: the loss is not a
    sum over rows, so a batch is not split into micro-batches (--grad-accum-steps) but, with `cache_chunk`, embedded
    and backpropagated in chunks (GradCache), which gives the one-pass gradients."""

    def __init__(self, module, config, pretrained_params, settings: TrainSettings, embedding: EmbeddingSettings,
                 source: str = "checkpoint", mesh=None):
        check_settings(settings)
        self.ranking, self.cache_chunk = ranking_loss(embedding), embedding.cache_chunk
        super().__init__(module, config, pretrained_params, None, settings, source=source, mesh=mesh)

    def check_memory(self, batch_size: int, row_shape: tuple[int, ...], training: bool) -> None:
        """A cached step holds one chunk's activations (and the batch's embeddings, [B, k, H]: small beside them)."""
        if training and self.cache_chunk and batch_size > self.cache_chunk:
            batch_size = self.cache_chunk
        super().check_memory(batch_size, row_shape, training)

    def _loss_and_grads(self, params, batch, rng):
        return embedding_loss_and_grads(self.module, self.ranking, self.cache_chunk)(params, batch, rng)


def embedding_loss_and_grads(module, ranking: contrastive.RankingLoss, cache_chunk: int):
    """(params, batch, rng) -> (loss, grads) of the ranking loss over the whole batch, cached in chunks of
    `cache_chunk` rows where the batch has more (0: one pass): what EmbeddingTrainer's step and `bertjax compile
    --embedding` run."""
    def loss_and_grads(params, batch, rng):
        rows = batch["input_ids"].shape[0]
        chunks = rows // cache_chunk if cache_chunk and rows > cache_chunk else 1
        if rows % chunks:
            raise ValueError(f"--cache-chunk {cache_chunk} does not divide a batch of {rows} rows")
        return contrastive.loss_and_grads(module, params, batch, rng, ranking, chunks=chunks)

    return loss_and_grads


def embed_texts(trainer: Trainer, texts: list[str], tokenizer, max_seq_length: int) -> np.ndarray:
    """float32 [len(texts), H]: the trained model's embeddings of `texts`."""
    features = {k: v[:, 0] for k, v in featurize([texts], tokenizer, max_seq_length).items()}
    return trainer.predict(features)


def dev_retrieval(trainer: Trainer, pairs: Pairs, tokenizer, max_seq_length: int) -> dict[str, float]:
    """The --dev pairs scored as retrieval (retrieval.retrieval_scores: recall@1/5/10, MRR@10, nDCG@10): each anchor's
    positive ranked among all the file's positives (retrieval.distinct_passages)."""
    passages, positives = retrieval.distinct_passages(pairs.positives)
    return retrieval.retrieval_scores(embed_texts(trainer, pairs.anchors, tokenizer, max_seq_length),
                                      embed_texts(trainer, passages, tokenizer, max_seq_length), positives)


def write_sentence_transformers(params, init, out_dir: str, embedding: EmbeddingSettings, max_seq_length: int) -> None:
    """`params` (the embedder's: the encoder under `bert`) as a sentence-transformers directory: the transformer's
    HF weights, config and tokenizer at its root (as `export_hf` writes a bare encoder), modules.json naming
    Transformer -> Pooling (-> Normalize), their configs. Written beside `out_dir` and renamed whole."""
    params = layer_layout.with_layout(jax.device_get({"bert": params["bert"]}), init.config, stacked=False)
    hidden = init.config.hidden_size
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if embedding.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": embedding.pooling == "cls",
               "pooling_mode_mean_tokens": embedding.pooling == "mean", "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "pooling_mode_lasttoken": False, "include_prompt": True}
    with replaced_when_whole(out_dir, directory=True) as partial:
        export_hf(params, init.config, init.vocab, partial, lower_case=init.lower_case, architecture="BertModel",
                  tokenizer=init.tokenizer)
        root = epath.Path(partial)
        files = {"modules.json": modules, "1_Pooling/config.json": pooling,
                 "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
                 "config_sentence_transformers.json": {
                     "__version__": {"sentence_transformers": SENTENCE_TRANSFORMERS_VERSION},
                     "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}}
        for name, content in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(json.dumps(content, indent=2), encoding="utf-8")
        if embedding.normalize:
            (root / "2_Normalize").mkdir()


def run(train: str, workdir: str, settings: TrainSettings, embedding: EmbeddingSettings, spec: PairSpec, *,
        init: str, dev: str | None = None, max_seq_length: int = 128, save_checkpoint: bool = True,
        export_hf: bool = False) -> dict:
    """Fine-tune an embedding model on `train`'s pairs; returns the metrics.json content. Every file is read and
    checked before the model is loaded, so a bad row fails in seconds."""
    check_settings(settings)
    console = Console()
    train_pairs = read_pairs(train, spec)
    dev_pairs = read_pairs(dev, spec) if dev else None
    ckpt, tokenizer = load_init(init)
    ckpt.config.check_length(max_seq_length, "--max-seq-length")
    out = epath.Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    module = SentenceEmbedder(ckpt.config, embedding.pooling, embedding.normalize,
                              embedding.scale if embedding.learned_scale else 0.0)
    trainer = EmbeddingTrainer(module, ckpt.config, ckpt.params, settings, embedding, source=init)
    # The pooler, where the checkpoint has one, goes into the export unchanged (the embeddings do not use it):
    # transformers' BertModel then loads every tensor it expects, as from the released sentence-transformers models.
    pooler = ckpt.params.get("bert", {}).get("pooler")
    ckpt.params = {}  # the Trainer holds its own copy
    columns = [train_pairs.anchors, train_pairs.positives] + ([train_pairs.negatives] if train_pairs.negatives
                                                              else [])
    train_features = featurize(columns, tokenizer, max_seq_length)
    console.line(f"{train}: {len(train_pairs.wheres):,} pairs" + (" with a hard negative each"
                                                                   if train_pairs.negatives else "")
                 + f"; each anchor scored against the batch's {len(columns) - 1} x --batch-size candidates")
    if embedding.cache_chunk:
        n_data = trainer.mesh.shape["data"] * trainer.mesh.shape["fsdp"]
        batch = trainer._rows_at_most(settings.batch_size, len(train_pairs.wheres))
        if batch > embedding.cache_chunk and batch % embedding.cache_chunk:
            raise ValueError(f"--cache-chunk {embedding.cache_chunk} does not divide the batch of {batch} rows "
                             f"(--batch-size {settings.batch_size}); give a divisor of it (a multiple of the "
                             f"{n_data} data-parallel devices)")
    train_info = trainer.train(train_features, workdir=workdir)
    del train_features
    metrics: dict = {}
    if dev_pairs is not None:
        metrics["dev"] = dev_retrieval(trainer, dev_pairs, tokenizer, max_seq_length)
        train_info["num_dev_pairs"] = len(dev_pairs.anchors)
        console.line(f"dev: {len(dev_pairs.anchors):,} anchors, each against the {len(set(dev_pairs.positives)):,} "
                     f"positives: {metric_text(metrics['dev'])}")
    if embedding.learned_scale:
        train_info["learned_scale"] = float(ranking_loss(embedding).scale_of(jax.device_get(trainer.params)))
    if save_checkpoint:
        write_fine_tuned({"bert": trainer.params["bert"]}, ckpt, workdir, bertjax_checkpoint=True, hf=False,
                         architecture="BertModel")
    if export_hf:
        encoder = {**trainer.params["bert"], **({"pooler": pooler} if pooler is not None else {})}
        write_sentence_transformers({"bert": encoder}, ckpt, str(out / "hf"), embedding, max_seq_length)
    result = {
        "task": "embedding", "metrics": metrics, "train": train, "dev": dev, "columns": dataclasses.asdict(spec),
        "hard_negatives": train_pairs.negatives is not None, "embedding": dataclasses.asdict(embedding),
        "num_train_examples": train_info.pop("num_train_rows"), "max_seq_length": max_seq_length,
        "settings": dataclasses.asdict(settings), **train_info,
        "total_seconds": time.perf_counter() - started, "init": init,
    }
    write_whole(out / "metrics.json", jsonio.dumps(result, indent=2))
    return result
