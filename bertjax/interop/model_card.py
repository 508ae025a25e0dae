"""The README.md of an exported HF directory, in the Hub's model-card format, from what the run recorded.

YAML front matter (license and language inherited from the base checkpoint's own card where it has one, the base
model's hub id, tags, the benchmark dataset where the job has one, and `model-index` with each metric and its
value), then what the model is, its base model, the command as it was typed (rerunnable), which step the weights
are and what chose it, the data files with their sizes and SHA-256, the settings and the results.

A fine-tune's card comes from WORKDIR/run.json (`argv`, and the `input:` fingerprints hashed when the run started)
and metrics.json; a pretraining run's from WORKDIR/config.json, inputs.json and metrics.jsonl (its `command`
event and last logged metrics), and for `data create` shards the corpus files their metadata records. Data files
and datasets are named by file name (and SHA-256 where the run hashed them), never by where they lay on the machine
that trained: the command block alone keeps the paths as typed. `hf upload DIR REPO` then publishes a complete
model; bertjax has no upload code.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import pathlib
import re
import shlex

import yaml
from etils import epath

from bertjax.data.data_config import split_format
from bertjax.data.schema import METADATA_SUFFIX
from bertjax.runtime import jsonio
from bertjax.runtime.input_files import INPUT_KEY
from bertjax.runtime.input_files import read_json, read_text
from bertjax.interop.hub import PACKAGED_CHECKPOINTS, is_hub_id, packaged_checkpoint
from bertjax.runtime.outputs import write_whole

CARD = "README.md"
# The Hub's pipeline tag of each head, and the benchmark each fine-tune job trains on (the Hub's dataset id).
PIPELINE_TAGS = {"BertForSequenceClassification": "text-classification",
                 "BertForTokenClassification": "token-classification",
                 "BertForQuestionAnswering": "question-answering", "BertForMultipleChoice": "multiple-choice",
                 "BertForMaskedLM": "fill-mask", "BertForPreTraining": "fill-mask", "BertModel": "feature-extraction"}
DATASETS = {"glue": "nyu-mll/glue", "squad": "rajpurkar/squad", "ner": "eriktks/conll2003",
            "multiple-choice": "allenai/swag"}
LOCAL_CHECKPOINT = "local checkpoint"
FROM_SCRATCH = "none (pretrained from scratch)"
# What a pretraining card shows of the last training record (metrics.jsonl holds throughput too).
PRETRAINING_METRICS = ("loss", "mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy", "sbo_loss", "sbo_accuracy")
_FINGERPRINT = re.compile(r"(\d+) bytes(?:, sha256 ([0-9a-f]+))?")


@dataclasses.dataclass
class RunFacts:
    """What a card tells of the run that trained the weights (each may be unknown: None or empty)."""

    argv: list[str] | None = None  # the command after `bertjax`, as typed
    init: str | None = None  # the checkpoint it started from, as the command gave it
    from_scratch: bool = False  # pretraining without one
    job: str | None = None  # the fine-tune job: its tag and benchmark dataset
    dataset: str | None = None  # the evaluated data's name (model-index), with its SHA-256 where known
    dataset_id: str | None = None  # its file name (model-index's dataset type, where no hub dataset is)
    configured_data: str = ""  # pretraining's data keys as configured
    files: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (file as named, its fingerprint)
    weights: str | None = None  # which step the weights are, and what chose it
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    metrics_note: str = ""  # where the metrics come from, where the table alone does not say
    settings: dict = dataclasses.field(default_factory=dict)


def base_card(path: str | None) -> dict:
    """The front matter of the README.md in the HF directory `path` (a hub id: the package that ships it, or the hub
    cache's copy; never downloaded), else {}."""
    if path and is_hub_id(path):
        path = packaged_checkpoint(path) or _cached_card_dir(path)
    if not path:
        return {}
    card = epath.Path(path) / CARD
    try:
        text = card.read_text() if card.exists() else ""
    except (OSError, ValueError):
        return {}
    if not text.startswith("---"):
        return {}
    try:
        data = yaml.safe_load(text.split("---", 2)[1])
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _cached_card_dir(hub_id: str) -> str | None:
    """The hub cache's snapshot directory holding `hub_id`'s README.md, or None (nothing is downloaded)."""
    try:
        import huggingface_hub
    except ImportError:
        return None
    found = huggingface_hub.try_to_load_from_cache(hub_id, CARD)
    return os.path.dirname(found) if isinstance(found, str) else None


def base_model(init: str) -> tuple[str, str | None]:
    """(how a card names the checkpoint `init`, as a command gave it; its hub id or None): a hub id as itself; a
    hub-cache snapshot or a known package's model by its hub id; another path as a local checkpoint, without the
    path where it lies inside an installed package (another machine's install is no place to find it)."""
    if is_hub_id(init):
        return init, init
    parts = pathlib.PurePath(init).parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and parts[i + 1:i + 2] == ("snapshots",):  # huggingface_hub's cache layout
            hub_id = part[len("models--"):].replace("--", "/")
            return hub_id, hub_id
        if part in ("site-packages", "dist-packages"):
            hub_id = PACKAGED_CHECKPOINTS.get(parts[i + 1] if i + 1 < len(parts) else "")
            return (hub_id, hub_id) if hub_id else (LOCAL_CHECKPOINT, None)
    return f"{LOCAL_CHECKPOINT} `{init}`", None


def shown_name(path: str) -> str:
    """A file or directory as a card names it: its name (where it lay on the training machine, perhaps a temporary
    or relative path, says nothing to a reader); gs://, hf: and tfds: names stay whole."""
    if "://" in path or path.startswith(("hf:", "tfds:")):
        return path
    return os.path.basename(os.path.normpath(path)) or path


def named_as_given(file: str, given: list[str]) -> str:
    """`file` (an absolute path, as run.json records it) by the name of what the command gave: a file given itself
    by its name; one in a directory given (the longest of the paths `given`, as typed, that it lies under) by the
    directory's name and its path inside (`conll2003/train.txt`); else its base name."""
    parts = pathlib.PurePath(file).parts
    best = (0, os.path.basename(file))
    for path in given:
        want = pathlib.PurePath(os.path.normpath(path)).parts
        for start in range(len(parts) - len(want), -1, -1):
            if parts[start:start + len(want)] == want:
                if len(want) > best[0]:
                    best = (len(want), os.path.join(shown_name(path), *parts[start + len(want):]))
                break
    return best[1]


def _hash_of(fingerprint: str | None) -> str | None:
    match = _FINGERPRINT.match(fingerprint or "")
    return match.group(2) if match else None


def _dataset_name(files: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    """(model-index's name for data `files` [(name, fingerprint)], with the first one's SHA-256; its id)."""
    if not files:
        return None, None
    name, fingerprint = files[0]
    pretty = f"{name}, sha256 {_hash_of(fingerprint)}" if _hash_of(fingerprint) else name
    more = f" and {len(files) - 1} more file{'s' if len(files) > 2 else ''}" if len(files) > 1 else ""
    return pretty + more, name + more


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


def metric_records(workdir: str) -> list[dict]:
    """WORKDIR/metrics.jsonl's records ([] without one); a line cut by a kill mid-write is left out."""
    path = epath.Path(workdir) / "metrics.jsonl"
    records = []
    lines = read_text(path, "the run's metrics (JSON Lines)").splitlines() if path.exists() else []
    for number, line in enumerate(lines, 1):
        try:
            records.append(jsonio.loads(line, f"{path}: line {number}", "a metrics record", row=True))
        except ValueError:
            continue
    return records


def finetune_facts(run: dict, result: dict) -> RunFacts:
    """A fine-tune's facts from its run.json (`run`) and metrics.json (`result`)."""
    best, ran, total = result.get("best") or {}, result.get("steps_run"), result.get("total_steps")
    if best.get("step") is not None:
        weights = (f"step {best['step']} of {ran}, the best evaluation by `{best['metric']}` ({best['value']:.4f}; "
                   f"`--metric-for-best`)")
    else:
        weights = f"step {ran} of {total}, the last" if ran is not None else None
    given = [value for key, value in run.items() if isinstance(value, str) and not key.startswith(INPUT_KEY)]
    files = [(named_as_given(key[len(INPUT_KEY):], given), value) for key, value in sorted(run.items())
             if key.startswith(INPUT_KEY)]
    job = run.get("job") or result.get("task")
    # A benchmark's task; own files: the file the metrics were computed on, by name and hash.
    dataset, dataset_id = (result.get("task") or job), None
    dev = run.get("dev") or result.get("dev")
    if job not in DATASETS and dev:
        dataset, dataset_id = _dataset_name([(shown_name(dev), _recorded_fingerprint(run, dev))])
    # The init as the command gave it (metrics.json's): run.json records it resolved, to compare runs by.
    return RunFacts(argv=run.get("argv"), init=result.get("init") or run.get("init"), job=job, dataset=dataset,
                    dataset_id=dataset_id, files=files, weights=weights,
                    metrics=flat_metrics(result.get("metrics") or {}), settings=result.get("settings") or {})


def _recorded_fingerprint(run: dict, given: str) -> str | None:
    """The fingerprint run.json holds for the file the command named `given` (recorded by its absolute path; a card
    written from another directory matches it by name)."""
    recorded = {key[len(INPUT_KEY):]: value for key, value in run.items() if key.startswith(INPUT_KEY)}
    if os.path.abspath(given) in recorded:
        return recorded[os.path.abspath(given)]
    same_name = [value for path, value in recorded.items() if os.path.basename(path) == os.path.basename(given)]
    return same_name[0] if len(same_name) == 1 else None


def shards_corpus(paths: list[str]) -> dict | None:
    """What `data create` recorded of the corpus the shards among `paths` were made from, in the metadata beside
    them: {"files": [(corpus file, fingerprint)] ("" where an older run recorded none), "inputs": the input
    patterns, "examples"}; None when no `data create` metadata lies beside `paths`."""
    found = None
    for directory in sorted({os.path.dirname(p) for p in paths}):
        for meta_path in sorted(epath.Path(directory).glob("*" + METADATA_SUFFIX)):
            try:
                meta = read_json(meta_path, "data create's metadata (JSON)")
            except (OSError, ValueError):
                continue
            if not isinstance(meta, dict) or "shards" not in meta:
                continue
            found = found or {"files": [], "inputs": [], "examples": 0}
            entries = [e.strip() for e in str((meta.get("config") or {}).get("input", "")).split(",") if e.strip()]
            inputs = [split_format(e)[1] for e in entries]
            found["inputs"] += [i for i in inputs if i not in found["inputs"]]
            found["files"] += sorted((meta.get("corpus_files") or {}).items()) or [(i, "") for i in inputs]
            found["examples"] += int(meta.get("examples") or 0)
    return found


def pretraining_facts(workdir: str, step: int) -> RunFacts:
    """A pretraining run's facts, for its checkpoint of `step`: the effective config (WORKDIR/config.json), the
    input files (inputs.json), the first run's command and the last metrics logged up to `step` (metrics.jsonl)."""
    root = epath.Path(workdir)

    def read(name):
        return read_json(root / name, f"the run's {name}") if (root / name).exists() else {}

    config, records = read("config.json"), [r for r in metric_records(workdir) if r.get("step", 0) <= step]
    command = next((r for r in records if r.get("event") == "command"), {})
    init = command.get("init") or config.get("init_from") or None
    data = config.get("data") or {}
    train = [r for r in records if "loss" in r and "event" not in r]
    evals = [r for r in records if any(k.startswith("eval_") for k in r) and "event" not in r]
    metrics, logged = {}, []
    if train:
        metrics.update({f"train {k}": train[-1][k] for k in PRETRAINING_METRICS
                        if isinstance(train[-1].get(k), (int, float))})
        logged.append(f"training's as logged at step {train[-1]['step']}")
    if evals:
        metrics.update({f"eval {k[len('eval_'):]}": v for k, v in evals[-1].items()
                        if k.startswith("eval_") and isinstance(v, (int, float))})
        logged.append(f"the evaluation's at step {evals[-1]['step']}")
    total = (config.get("train") or {}).get("steps")
    inputs = sorted(read("inputs.json").items())
    corpus = shards_corpus([path for path, _ in inputs])
    if corpus:  # `data create` shards: the corpus they were made from, not the shards
        files = [(named_as_given(path, corpus["inputs"]), value) for path, value in corpus["files"]]
    else:
        files = [(named_as_given(path, _entries(data.get("input", ""))), value) for path, value in inputs]
    configured = [f"data.{k}=`{','.join(shown_name(e) for e in _entries(data[k]))}`"
                  for k in ("input", "eval_input") if data.get(k)]
    if corpus:
        configured[0] += (f" ({corpus['examples']:,} examples of TFRecord shards that `bertjax data create` made from "
                          "the corpus below)")
    if evals and data.get("eval_input"):
        dataset = dataset_id = ",".join(shown_name(e) for e in _entries(data["eval_input"]))
    else:
        dataset, dataset_id = _dataset_name(files)
    return RunFacts(argv=command.get("argv"), init=init, from_scratch=init is None and bool(command),
                    dataset=dataset, dataset_id=dataset_id, configured_data=", ".join(configured), files=files,
                    weights=f"step {step} of train.steps={total}" if total else f"step {step}", metrics=metrics,
                    metrics_note=f"Metrics: {', '.join(logged)}." if logged else "")


def _entries(value: str) -> list[str]:
    """The patterns of a comma-separated data.input (a FORMAT: prefix left out)."""
    return [split_format(e.strip())[1] for e in str(value).split(",") if e.strip()]


def card_text(hf_config: dict, facts: RunFacts | None = None, *, name: str = "model",
              license_from: str | None = None) -> str:
    """The model card of an HF directory with `hf_config` (its config.json), trained by the run of `facts` (None:
    a checkpoint exported without its run); license and language from the card at `license_from` (default: the
    base checkpoint's)."""
    trained_here, facts = facts is not None, facts or RunFacts()
    inherited = base_card(license_from or facts.init)
    base, hub_id = None, None
    if facts.from_scratch:
        base = FROM_SCRATCH
    elif facts.init:
        base, hub_id = base_model(facts.init)
    architecture = (hf_config.get("architectures") or ["BertModel"])[0]
    # By the task (BERT's class name) whatever the family: ModernBertForMaskedLM is a fill-mask model too.
    from bertjax.model.family import task_architecture

    task = task_architecture(architecture)
    # `finetune embedding`'s export is a sentence-transformers directory: the Hub files it under that library.
    sentence_model = facts.job == "embedding"
    pipeline_tag = "sentence-similarity" if sentence_model else PIPELINE_TAGS.get(task, "feature-extraction")
    front = {"license": inherited.get("license", "other")}
    if "language" in inherited:
        front["language"] = inherited["language"]
    front["library_name"] = "sentence-transformers" if sentence_model else "transformers"
    if hub_id:
        front["base_model"] = hub_id
    front["pipeline_tag"] = pipeline_tag
    front["tags"] = ["bertjax", hf_config.get("model_type", "bert"), pipeline_tag] + ([facts.job] if facts.job else [])
    if facts.job in DATASETS:
        front["datasets"] = [DATASETS[facts.job]]
    if facts.metrics:
        dataset = str(facts.dataset or facts.job or "unknown")
        front["model-index"] = [{"name": name, "results": [{
            "task": {"type": pipeline_tag, "name": pipeline_tag.replace("-", " ")},
            "dataset": {"name": dataset, "type": DATASETS.get(facts.job) or facts.dataset_id or dataset},
            "metrics": [{"type": key.split()[-1], "value": value, "name": key}
                        for key, value in facts.metrics.items()],
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
        lines += [f"Base model: {base}.", ""]
    if trained_here:
        lines += ["## Training", ""]
        lines += ["```bash", "bertjax " + shlex.join(facts.argv), "```", ""] if facts.argv else \
            ["The command was not recorded (a run of an older bertjax).", ""]
        if facts.weights:
            lines += [f"Weights: {facts.weights}.", ""]
        if facts.configured_data:
            lines += [f"Data: {facts.configured_data}.", ""]
        lines += _files_table(facts.files)
    if facts.settings:
        lines += ["| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in facts.settings.items()] + [""]
    if facts.metrics:
        lines += ["## Results", ""] + ([facts.metrics_note, ""] if facts.metrics_note else []) + \
                 ["| metric | value |", "|---|---|"] + [f"| {k} | {v:.4f} |" for k, v in facts.metrics.items()] + [""]
    use = (["from sentence_transformers import SentenceTransformer", 'model = SentenceTransformer("REPO")']
           if sentence_model else
           ["from transformers import pipeline", f'pipe = pipeline("{pipeline_tag}", model="REPO")'])
    lines += ["## Use", "", "```python", *use, "```", "",
              "Publish this directory with the Hub's own client: `hf upload REPO DIR`.", ""]
    return "\n".join(lines)


def _files_table(files: list[tuple[str, str]]) -> list[str]:
    """The data files as table lines: name, size and (where the run hashed them) the SHA-256's first 16 digits."""
    if not files:
        return []
    found = [(file, _FINGERPRINT.match(value)) for file, value in files]
    hashed = any(match and match.group(2) for _, match in found)
    lines = ["| file | bytes |" + (" SHA-256 (first 16 hex digits) |" if hashed else ""),
             "|---|---|" + ("---|" if hashed else "")]
    for file, match in found:
        size = f"{int(match.group(1)):,}" if match else "?"
        lines.append(f"| {file} | {size} |" + (f" {match.group(2) if match else '?'} |" if hashed else ""))
    return lines + [""]


def run_of(checkpoint: str) -> tuple[str | None, int | None]:
    """(the run directory that saved `checkpoint`, the pretraining step): a fine-tune's WORKDIR for
    WORKDIR/checkpoint, a pretraining WORKDIR for WORKDIR/checkpoints/<step>; (None, None) for other checkpoints."""
    path = epath.Path(checkpoint)
    if (path.parent / "metrics.json").exists():
        return str(path.parent), None
    if path.parent.name == "checkpoints" and path.name.isdigit() and (path.parent.parent / "config.json").exists():
        return str(path.parent.parent), int(path.name)
    return None, None


def write_card(hf_dir: str, run_dir: str | None = None, record_dir: str | None = None, *, step: int | None = None,
               source: str | None = None, name: str | None = None) -> str:
    """Writes <hf_dir>/README.md from its config.json and the run in `run_dir`: a fine-tune's (its metrics.json;
    run.json in `record_dir`, default `run_dir` or, for a task of `glue --task all`, the directory above it) or a
    pretraining workdir's, for its checkpoint of `step`. Without a run, the card of the exported checkpoint
    `source`, titled `name` (default: hf_dir's). Returns the path."""
    out = epath.Path(hf_dir)
    facts = None
    if run_dir and (epath.Path(run_dir) / "metrics.json").exists():
        records = [epath.Path(d) / "run.json" for d in ([record_dir] if record_dir else
                                                        [run_dir, epath.Path(run_dir).parent])]
        record = next((p for p in records if p.exists()), None)
        facts = finetune_facts(read_json(record, "a fine-tune's run record") if record else {},
                               read_json(epath.Path(run_dir) / "metrics.json", "a fine-tune's metrics"))
    elif run_dir:
        facts = pretraining_facts(run_dir, step)
    text = card_text(read_json(out / "config.json", "the export's config.json"), facts,
                     license_from=None if facts else source,
                     name=epath.Path(run_dir).name if run_dir else name or out.name)
    write_whole(out / CARD, text)
    return str(out / CARD)
