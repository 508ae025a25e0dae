"""The README.md of an exported HF directory, in the Hub's model-card format, from what the run recorded.

YAML front matter (license and language inherited from the base checkpoint's own card where it has one, tags,
the benchmark dataset where the job has one, and `model-index` with each metric and its value), then what the
model is, the base checkpoint, the training command and settings, and the results table. `hf upload DIR REPO`
then publishes a complete model; bertjax has no upload code of its own.
"""
from __future__ import annotations

import json
import numbers

import yaml
from etils import epath

CARD = "README.md"
# The Hub's pipeline tag of each head, and the benchmark each fine-tune job trains on (the Hub's dataset id).
PIPELINE_TAGS = {"BertForSequenceClassification": "text-classification",
                 "BertForTokenClassification": "token-classification",
                 "BertForQuestionAnswering": "question-answering", "BertForMultipleChoice": "multiple-choice",
                 "BertForMaskedLM": "fill-mask", "BertForPreTraining": "fill-mask", "BertModel": "feature-extraction"}
DATASETS = {"glue": "nyu-mll/glue", "squad": "rajpurkar/squad", "ner": "eriktks/conll2003",
            "multiple-choice": "allenai/swag"}


def base_card(init: str | None) -> dict:
    """The front matter of the base checkpoint's own README.md (an HF directory's), else {}."""
    if not init:
        return {}
    path = epath.Path(init) / CARD
    try:
        text = path.read_text() if path.exists() else ""
    except (OSError, ValueError):
        return {}
    if not text.startswith("---"):
        return {}
    try:
        data = yaml.safe_load(text.split("---", 2)[1])
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def flat_metrics(metrics: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves as {"dev accuracy": 0.9}; of NER's per-type scores only the "overall" ones."""
    out = {}
    for key, value in metrics.items():
        name = f"{prefix} {key}".strip()
        if isinstance(value, dict):
            if "overall" in value:
                value = {"overall": value["overall"]}
            out.update(flat_metrics(value, name))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def command_line(run: dict) -> str:
    """The `bertjax finetune JOB ...` command that a run.json records."""
    parts = ["bertjax", "finetune", str(run.get("job", "?"))]
    for key, value in sorted(run.items()):
        if key == "job" or value is None or value is False:
            continue
        parts.append("--" + key.replace("_", "-"))
        if value is not True:
            parts.append(str(value))
    return " ".join(parts)


def card_text(hf_config: dict, *, run: dict | None = None, result: dict | None = None, base: str | None = None,
              name: str = "model") -> str:
    """The model card of an HF directory with `hf_config` (its config.json), fine-tuned by the run whose
    run.json is `run` and metrics.json `result` (either may be None: an exported pretraining checkpoint)."""
    run, result = run or {}, result or {}
    base = base or run.get("init") or result.get("init")
    inherited = base_card(base)
    architecture = (hf_config.get("architectures") or ["BertModel"])[0]
    pipeline_tag = PIPELINE_TAGS.get(architecture, "feature-extraction")
    job = run.get("job")
    metrics = flat_metrics(result.get("metrics") or {})
    task_name = result.get("task") or job or "fine-tuning"
    front = {"license": inherited.get("license", "other")}
    if "language" in inherited:
        front["language"] = inherited["language"]
    front["library_name"] = "transformers"
    front["pipeline_tag"] = pipeline_tag
    front["tags"] = ["bertjax", "bert", pipeline_tag] + ([job] if job else [])
    if job in DATASETS:
        front["datasets"] = [DATASETS[job]]
    if metrics:
        dataset = {"name": str(task_name), "type": DATASETS.get(job, str(task_name))}
        front["model-index"] = [{"name": name, "results": [{
            "task": {"type": pipeline_tag, "name": pipeline_tag.replace("-", " ")}, "dataset": dataset,
            "metrics": [{"type": key.split()[-1], "value": value, "name": key} for key, value in metrics.items()],
        }]}]
    labels = hf_config.get("id2label") or {}
    lines = ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(), "---", "",
             f"# {name}", "",
             f"A {architecture} ({hf_config.get('num_hidden_layers')} layers, hidden size "
             f"{hf_config.get('hidden_size')}, {hf_config.get('num_attention_heads')} heads, vocabulary "
             f"{hf_config.get('vocab_size')}) trained with bertjax (JAX/Flax) and exported "
             f"to transformers' PyTorch layout." +
             (f" Problem type: {hf_config['problem_type']}." if hf_config.get("problem_type") else "") +
             (f" Labels: {', '.join(str(labels[k]) for k in sorted(labels, key=int))}." if labels else ""), ""]
    if base:
        lines += [f"Base checkpoint: `{base}`.", ""]
    if run:
        lines += ["## Training", "", "```", command_line(run), "```", ""]
    settings = result.get("settings") or {}
    if settings:
        lines += ["| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in settings.items()] + [""]
    if metrics:
        lines += ["## Results", "", "| metric | value |", "|---|---|"] + \
                 [f"| {k} | {v:.4f} |" for k, v in metrics.items()] + [""]
    lines += ["## Use", "", "```python", "from transformers import pipeline",
              f'pipe = pipeline("{pipeline_tag}", model="REPO")', "```", "",
              "Publish this directory with the Hub's own client: `hf upload REPO DIR`.", ""]
    return "\n".join(lines)


def write_card(hf_dir: str, run_dir: str | None = None, base: str | None = None,
               record_dir: str | None = None) -> str:
    """Writes <hf_dir>/README.md from its config.json and, where they exist, the run's metrics.json in `run_dir`
    and run.json in `record_dir` (default `run_dir`; `glue --task all` records one run above its tasks); returns
    the path."""
    out = epath.Path(hf_dir)

    def read(directory, file):
        path = epath.Path(directory) / file if directory else None
        return json.loads(path.read_text()) if path is not None and path.exists() else None

    text = card_text(json.loads((out / "config.json").read_text()), base=base,
                     run=read(record_dir or run_dir, "run.json"), result=read(run_dir, "metrics.json"),
                     name=epath.Path(run_dir).name if run_dir else out.name)
    (out / CARD).write_text(text, encoding="utf-8")
    return str(out / CARD)
