"""The feature-based GLUE job: a frozen encoder's pooled hidden states under a scikit-learn classifier.

The BERT paper's feature-based approach and the common "embed sentences, fit a logistic regression" walk-through:
no gradient reaches the encoder. The GLUE files are read and encoded as in the fine-tuning job (glue_data), the
features are `bertjax.finetune.embed.encoded_features` (any --layers / cls|mean pooling), and the dev metric is the GLUE
one (glue_metrics).

Classifier (`logreg`): scikit-learn's LogisticRegressionCV (L2, lbfgs) over standardised features, C chosen by
stratified k-fold cross-validation on the training features, then refit on all of them. LogisticRegressionCV
rather than GridSearchCV over a pipeline: it walks the C grid warm-started from the previous solution, which is
several times cheaper on a small CPU, and the standardisation it then sees is fitted on the whole training set,
which holds no dev information. The CV score is accuracy, CoLA's is the Matthews correlation (its GLUE metric).
Regression (STS-B): RidgeCV over the same standardised features, alpha chosen by efficient leave-one-out.

Writes <workdir>/metrics.json, dev_predictions.tsv (row, prediction, label) and, where the data has test files,
GLUE's submission file(s) (<TASK>.tsv: index, prediction), as the fine-tuning job does.
"""
from __future__ import annotations

import inspect
import logging
import math
import os
import time

import numpy as np

from bertjax.runtime import jsonio
from bertjax.runtime.console import Console, Progress
from bertjax.finetune import glue_data, glue_metrics
from bertjax.finetune.embed import encoded_features, parse_layers
from bertjax.runtime.outputs import open_whole

log = logging.getLogger(__name__)

CLASSIFIERS = ("logreg",)
C_GRID = tuple(float(c) for c in np.logspace(-4, 2, 7))       # 1e-4 ... 1e2
ALPHA_GRID = tuple(float(a) for a in np.logspace(-2, 4, 7))   # ridge penalties for regression


def subsample(examples: glue_data.Examples, max_examples: int | None, seed: int) -> glue_data.Examples:
    """A random subset of `max_examples` rows (all when None or larger), in file order; seeded."""
    if max_examples is not None and max_examples < 1:
        raise ValueError(f"max_train_examples={max_examples} must be >= 1")
    if max_examples is None or max_examples >= len(examples):
        return examples
    keep = np.sort(np.random.default_rng(seed).choice(len(examples), max_examples, replace=False))
    return glue_data.Examples(
        [examples.guids[i] for i in keep], [examples.text_a[i] for i in keep],
        None if examples.text_b is None else [examples.text_b[i] for i in keep],
        None if examples.labels is None else examples.labels[keep])


def fit_predict(train_x: np.ndarray, train_y: np.ndarray, eval_x: np.ndarray, *, regression: bool,
                scoring: str = "accuracy", cv_folds: int = 5, seed: int = 42, max_iter: int = 2000,
                console: Console | None = None):
    """Fit the classifier (regressor) on training features; returns (predictions for eval_x, fit info).

    The one fitting routine: the job and the parity bench (bench/feature_classifier.py) both call it, so the
    two sides of a comparison share every setting. `console`: where the cross-validation's progress goes
    (folds done, ETA; none without one).
    """
    try:
        from sklearn.linear_model import LogisticRegressionCV, RidgeCV
        from sklearn.metrics import get_scorer
        from sklearn.model_selection import StratifiedKFold
        from sklearn.preprocessing import StandardScaler
    except ImportError:
        raise ImportError("`finetune features` needs scikit-learn: pip install scikit-learn") from None

    scaler = StandardScaler().fit(train_x)
    train_x, eval_x = scaler.transform(train_x), scaler.transform(eval_x)
    if regression:
        model = RidgeCV(alphas=ALPHA_GRID).fit(train_x, train_y)
        return model.predict(eval_x), {"regressor": "RidgeCV", "alpha": float(model.alpha_),
                                       "alpha_grid": list(ALPHA_GRID)}
    folds = StratifiedKFold(n_splits=cv_folds, shuffle=True, random_state=seed)
    extra = {}
    if "use_legacy_attributes" in inspect.signature(LogisticRegressionCV).parameters:
        # scikit-learn >= 1.8: plain L2 said explicitly, and the simplified fitted attributes.
        extra = {"l1_ratios": (0.0,), "use_legacy_attributes": False}
    scorer = get_scorer(scoring)
    if console is not None:
        scorer = _FoldCounter(scorer, Progress(
            f"cross-validating C on {len(train_y):,} rows", cv_folds, unit="fold", console=console,
            detail=f", {len(C_GRID)} values of C each"), len(C_GRID))
    model = LogisticRegressionCV(Cs=list(C_GRID), cv=folds, scoring=scorer, max_iter=max_iter,
                                 random_state=seed, **extra).fit(train_x, train_y)
    if console is not None:
        scorer.progress.close(f"cross-validated C and refitted on all {len(train_y):,} rows")
    # scores_: [folds, (l1_ratios,) Cs], or (older releases) {class: [folds, Cs]} with equal entries.
    scores = next(iter(model.scores_.values())) if isinstance(model.scores_, dict) else model.scores_
    cv_scores = np.asarray(scores).reshape(cv_folds, -1).mean(axis=0)
    return model.predict(eval_x), {
        "classifier": "LogisticRegressionCV", "C": float(np.ravel(model.C_)[0]), "C_grid": list(C_GRID),
        "cv_folds": cv_folds, "cv_scoring": scoring, "cv_mean_scores": [float(s) for s in cv_scores]}


class _FoldCounter:
    """A scorer that advances a Progress once per fold: LogisticRegressionCV scores each fold's path once per C,
    in this process (no n_jobs), after fitting it."""

    def __init__(self, scorer, progress: Progress, per_fold: int):
        self.scorer, self.progress, self.per_fold, self.calls = scorer, progress, per_fold, 0

    def __call__(self, estimator, x, y, **kwargs):
        score = self.scorer(estimator, x, y, **kwargs)
        self.calls += 1
        if self.calls % self.per_fold == 0:
            self.progress.advance()
        return score


def run_task(task_name: str, data: str, workdir: str, *, init: str | None = None, loaded=None,
             layers: str = "last", pooling: str = "cls", classifier: str = "logreg", max_seq_length: int = 128,
             max_train_examples: int | None = None, max_eval_examples: int = 0, batch_size: int = 64,
             cv_folds: int = 5, seed: int = 42) -> dict:
    """Extract features, fit, score the dev split(s), writing into `workdir`; returns the metrics.json content."""
    from bertjax.interop.load import load_init

    if classifier not in CLASSIFIERS:
        raise ValueError(f"unknown classifier {classifier!r}; expected one of {', '.join(CLASSIFIERS)}")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"pooling {pooling!r}: a classifier needs one vector per example (cls or mean)")
    task = glue_data.get_task(task_name)
    splits = glue_data.load_task(task, data)
    ckpt, tokenizer = loaded if loaded is not None else load_init(init)
    ckpt.config.check_length(max_seq_length, "--max-seq-length")
    parse_layers(layers, ckpt.config.num_hidden_layers)  # a bad spec fails before any encoding
    train = subsample(splits["train"], max_train_examples, seed)
    out_dir = workdir
    os.makedirs(out_dir, exist_ok=True)

    dev = {split.name: splits[f"dev:{split.name}"].head(max_eval_examples) for split in task.splits}
    tests = {split: splits[f"test:{split.name}"] for split in task.splits if f"test:{split.name}" in splits}
    sizes = [len(train)] + [len(e) for e in dev.values()] + [len(e) for e in tests.values()]
    progress = Progress(f"{task.name}: extracting features of {sum(sizes):,} rows",
                        sum(math.ceil(n / batch_size) for n in sizes),
                        detail=f" of {batch_size}: {len(train):,} train, {sum(sizes[1:len(dev) + 1]):,} dev, "
                               f"{sum(sizes[len(dev) + 1:]):,} test")

    def features(examples):
        arrays = glue_data.featurize(examples, tokenizer, max_seq_length)
        return encoded_features(ckpt, arrays, layers=layers, pooling=pooling, batch_size=batch_size,
                                progress=progress)

    train_x = features(train)
    dev_x = {name: features(examples) for name, examples in dev.items()}
    test_x = [features(examples) for examples in tests.values()]
    feature_seconds = progress.close(f"{task.name}: features of {sum(sizes):,} rows ({train_x.shape[1]} wide)")

    started = time.perf_counter()
    names = list(dev)
    stacked = np.concatenate([dev_x[n] for n in names] + test_x)  # one fit scores dev and test rows
    preds, fit_info = fit_predict(train_x, train.labels, stacked, regression=task.is_regression,
                                  scoring="matthews_corrcoef" if task.name == "cola" else "accuracy",
                                  cv_folds=cv_folds, seed=seed, console=Console())
    fit_seconds = time.perf_counter() - started
    metrics, offset = {}, 0
    with open_whole(os.path.join(out_dir, "dev_predictions.tsv"), "w", encoding="utf-8") as f:
        f.write("split\tindex\tprediction\tlabel\n")
        for name in names:
            labels = dev[name].labels
            split_preds = preds[offset:offset + len(labels)]
            offset += len(labels)
            metrics[name] = glue_metrics.compute_metrics(task.name, split_preds, labels)
            for guid, pred, label in zip(dev[name].guids, split_preds, labels):
                f.write(f"{name}\t{guid}\t{glue_data.label_name(task, pred)}\t{glue_data.label_name(task, label)}\n")
    for (split, examples) in tests.items():
        glue_data.write_submission(task, os.path.join(out_dir, split.submission), examples.guids,
                                   preds[offset:offset + len(examples.guids)])
        offset += len(examples.guids)
    score = float(np.mean([glue_metrics.task_score(task.name, m) for m in metrics.values()]))
    result = {"task": task.name, "metrics": metrics, "score": score, "layers": layers, "pooling": pooling,
              "feature_width": int(train_x.shape[1]), "num_train_examples": len(train),
              "num_train_available": len(splits["train"]), "max_seq_length": max_seq_length, "seed": seed,
              **fit_info, "feature_seconds": feature_seconds, "fit_seconds": fit_seconds, "init": init}
    with open_whole(os.path.join(out_dir, "metrics.json"), "w") as f:
        jsonio.dump(result, f, indent=2)
    log.info("%s: score %.4f (%s; the metrics: the line below and metrics.json)", task.name, score,
             f"C={fit_info['C']:g}" if "C" in fit_info else f"alpha={fit_info['alpha']:g}")
    return result
