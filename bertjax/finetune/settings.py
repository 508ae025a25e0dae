"""Fine-tuning options, each defined once: the shared training settings and SQuAD's own. The `finetune` command
line derives its flags from these fields (no JAX here, so building the parser stays fast)."""
from __future__ import annotations

import dataclasses

from bertjax.options import floats, ints, option, range_problems

# The most passes over a training set a fine-tune takes: far beyond any recipe's (BERT's 2-4, a tiny set's dozens),
# and a bound the parser checks (`--epochs 1e30` passed it and failed later on a step count naming no flag).
MAX_EPOCHS = 100_000


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The training loop of every fine-tuning job (BERT paper's recipe; each job sets its own lr/batch/epochs)."""

    learning_rate: float = option(2e-5, "peak learning rate (linear warmup, then linear decay to 0)",
                                  valid=floats(0, low_open=True))
    batch_size: int = option(32, "sequences per step", valid=ints(1))
    epochs: float = option(3.0, "passes over the training set (fractions allowed)",
                           valid=floats(0, MAX_EPOCHS, low_open=True))
    warmup_proportion: float = option(0.1, "share of the steps spent warming up", valid=floats(0, 1))
    weight_decay: float = option(0.01, "AdamW decoupled weight decay (not on LayerNorm and biases)",
                                 valid=floats(0))
    max_grad_norm: float = option(1.0, "global gradient-norm clip (0: none)", valid=floats(0))
    seed: int = option(42, "head initialisation, dropout and example order", valid=ints(0))
    eval_batch_size: int = option(64, "sequences per prediction step (never fewer than --batch-size)",
                                  valid=ints(1))
    length_bucket: int = option(32, "pad each batch's length up to a multiple of this (fewer compiled shapes)",
                                valid=ints(1))
    log_every: int = option(50, "steps between metrics.jsonl records (the console also gets a line every tenth of "
                            "the run and every 30 s)", valid=ints(1))
    max_consecutive_nonfinite: int = option(10, "this many non-finite gradients in a row stop the job (each one "
                                            "skips its update)", valid=ints(1))
    compilation_cache_dir: str = option("", "JAX's persistent compilation cache (local or gs://): '' = "
                                        "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/bertjax/jax; 'off' = none")
    max_steps: int = option(0, "stop after this many steps (0: the epochs decide); the schedule spans them",
                            valid=ints(0))
    max_train_examples: int = option(0, "train on a seeded random subset of this many training rows (a SQuAD or "
                                     "NER window counts as one; 0: all), for quick runs", valid=ints(0))
    max_eval_examples: int = option(0, "evaluate and predict on the first N examples of each split (GLUE dev and "
                                    "test rows, SQuAD questions, NER sentences, multiple-choice rows; 0: all), for "
                                    "quick runs", valid=ints(0))
    predict_test: bool = option(True, "predict the test split(s) where the data has them (GLUE submission files, "
                                "NER test.txt, SWAG test.csv); --no-predict-test skips them")
    eval_every: int = option(0, "also record dev metrics every N steps (0: only at the end)", valid=ints(0))
    dtype: str = option("float32", "compute dtype of the matmuls: float32 | bfloat16 (mixed precision: float32 "
                        "master weights and optimizer state; softmax, LayerNorm and losses in float32)")
    grad_accum_steps: int = option(1, "split each batch into this many micro-batches, their gradients summed into "
                                   "one update (the same update for 1/N of the activation memory; NER's token "
                                   "mean is then per micro-batch)", valid=ints(1))
    metric_for_best: str = option("", "dev metric as the evaluation names it (e.g. accuracy, f1, macro_f1, "
                                  "pearson): the params of its best evaluation are kept and exported, not the "
                                  "last; evaluated every --eval-every steps, else after every epoch. Higher is "
                                  "better, except for names holding loss, mse or error")
    early_stopping_patience: int = option(0, "stop after this many evaluations in a row without a better "
                                          "--metric-for-best (0: never)", valid=ints(0))
    save_every: int = option(1000, "steps between saves of the training state in WORKDIR/train_state, the newest "
                             "two kept (a rerun of the same command resumes from the newest that reads, "
                             "bit-exactly; SIGTERM saves too); 0: only on SIGTERM", valid=ints(0))

    def __post_init__(self):
        problems = range_problems(self)
        if self.dtype not in ("float32", "bfloat16"):
            problems.append(f"dtype={self.dtype!r} must be float32 or bfloat16")
        if self.grad_accum_steps >= 1 and self.batch_size % self.grad_accum_steps:
            problems.append(f"batch_size={self.batch_size} is not divisible by grad_accum_steps="
                            f"{self.grad_accum_steps}")
        if self.early_stopping_patience and not self.metric_for_best:
            problems.append("early_stopping_patience needs metric_for_best (the metric whose evaluations it counts)")
        if problems:
            raise ValueError("fine-tuning settings: " + "; ".join(problems))


def check_metric_for_best(settings: TrainSettings, metric_names) -> None:
    """--metric-for-best checked before the checkpoint loads: `metric_names` are what the job's evaluation returns
    (derived from its metric function), None for a run without a dev set to evaluate."""
    metric = settings.metric_for_best
    if not metric:
        return
    if metric_names is None:
        raise ValueError(f"--metric-for-best {metric}: this run has no dev set to evaluate")
    if metric not in metric_names:
        raise ValueError(f"--metric-for-best {metric!r} is not among this job's dev metrics; expected one of "
                         f"{', '.join(sorted(metric_names))}")


def greater_is_better(metric: str) -> bool:
    """Whether a higher value of `metric` is the better one (not for losses and errors)."""
    return not any(word in metric.lower() for word in ("loss", "mse", "error"))


def derived(settings, name: str, value: int) -> None:
    """Sets the field `name` of the frozen `settings` to `value` where it was left None: a default that follows the
    length it goes with (a window's stride, the question's share of it), so that changing the length alone never
    leaves a default that does not fit it. The instance then holds, and its run records, the value used."""
    if getattr(settings, name) is None:
        object.__setattr__(settings, name, value)


@dataclasses.dataclass(frozen=True)
class SquadSettings:
    """SQuAD windowing and answer decoding (run_squad.py's flags and defaults; at its 384 tokens a window, its stride
    128 and query 64, which the derived defaults keep)."""

    version: str = option("1.1", "1.1 | 2.0 (2.0 may predict no answer)")
    max_seq_length: int = option(384, "tokens per window", valid=ints(5))
    doc_stride: int | None = option(None, "tokens between window starts (default: a third of --max-seq-length, "
                                    "128 of 384)", valid=ints(1))
    max_query_length: int | None = option(None, "question tokens kept (default: a quarter of --max-seq-length, at "
                                          "most 64: run_squad.py's 64 of 384)", valid=ints(1))
    n_best_size: int = option(20, "candidates per question in nbest_predictions.json", valid=ints(1))
    max_answer_length: int = option(30, "longest answer in tokens", valid=ints(1))
    null_score_diff_threshold: float = option(0.0, "2.0: predict no answer when null score - best > this",
                                              valid=floats())

    def __post_init__(self):
        if self.version not in ("1.1", "2.0"):
            raise ValueError(f"SQuAD version {self.version!r}; expected 1.1 or 2.0")
        derived(self, "doc_stride", max(self.max_seq_length // 3, 1))
        # A quarter, capped at run_squad.py's 64: a sixth kept 21 tokens of a 128-token window, cutting questions
        # that BERT's own defaults would have kept whole (few SQuAD questions pass 32 WordPiece tokens).
        derived(self, "max_query_length", max(min(self.max_seq_length // 4, 64), 1))
        problems = range_problems(self)
        if problems:
            raise ValueError("SQuAD settings: " + "; ".join(problems))

    @property
    def version_2(self) -> bool:
        return self.version.startswith("2")


@dataclasses.dataclass(frozen=True)
class NerSettings:
    """CoNLL-2003 NER windowing (the label sits on each word's first sub-token)."""

    max_seq_length: int = option(128, "tokens per window, [CLS] and [SEP] included", valid=ints(3))
    doc_stride: int | None = option(None, "sub-tokens between window starts when a sentence needs several windows "
                                    "(default: half of --max-seq-length, 64 of 128)", valid=ints(1))

    def __post_init__(self):
        derived(self, "doc_stride", self.max_seq_length // 2)
        problems = range_problems(self)
        if problems:
            raise ValueError("NER settings: " + "; ".join(problems))
        if not 1 <= self.doc_stride <= self.max_seq_length - 2:
            raise ValueError(f"doc_stride={self.doc_stride} must be in [1, max_seq_length - 2 = "
                             f"{self.max_seq_length - 2}]")


# What the ranking loss's learned scale is bounded by (CLIP's logit scale is clipped at 100: past it the softmax is
# nearly a max); --scale too.
MAX_SCALE = 100.0
POOLINGS = ("mean", "cls")


@dataclasses.dataclass(frozen=True)
class EmbeddingSettings:
    """The model and loss `finetune embedding` trains (sentence-transformers' Pooling, Normalize and
    MultipleNegativesRankingLoss, its defaults)."""

    pooling: str = option("mean", "mean: the mean of the tokens' vectors (padding excluded); cls: the first token's")
    normalize: bool = option(True, "unit-length embeddings (the export's Normalize module); --no-normalize: none")
    scale: float = option(20.0, "what cosine similarities are multiplied by before the softmax (sentence-"
                          "transformers' 20); with --learned-scale, its start", valid=floats(0, MAX_SCALE,
                                                                                               low_open=True))
    learned_scale: bool = option(False, "learn the scale (as its log; at most 100, CLIP's bound)")
    symmetric: bool = option(False, "also each positive against every anchor, the two terms averaged (sentence-"
                             "transformers' MultipleNegativesSymmetricRankingLoss)")
    cache_chunk: int = option(0, "cached gradients (GradCache): embed and backpropagate the batch in chunks of this "
                              "many rows, the one-pass gradients in one chunk's activation memory (0: one pass)",
                              valid=ints(0))

    def __post_init__(self):
        problems = range_problems(self)
        if self.pooling not in POOLINGS:
            problems.append(f"pooling={self.pooling!r} must be one of {', '.join(POOLINGS)}")
        if problems:
            raise ValueError("embedding settings: " + "; ".join(problems))
