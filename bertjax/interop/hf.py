"""HuggingFace BERT directories (config.json + safetensors/pytorch_model.bin + vocab) <-> bertjax params.

Import accepts BertModel, BertForPreTraining, BertForMaskedLM, BertForSequenceClassification,
BertForMultipleChoice (read as a one-output classifier head), BertForTokenClassification and BertForQuestionAnswering
dumps (the classifiers hold `classifier.*`; the token classifier has no pooler). Export writes safetensors in the
PyTorch key layout (transformers v5 has no Flax models), loadable by `transformers.<Architecture>.from_pretrained`
and `AutoTokenizer.from_pretrained`. A SpanBERT SBO head, which HF BERT has no place for, goes to its own file
beside them (names.SBO_FILE).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import uuid
from typing import Mapping

import numpy as np
from etils import epath
from safetensors.numpy import load, load_file, save

from bertjax.checkpoint import read_vocab_file
from bertjax.interop import convert
from bertjax.interop import names as names_lib
from bertjax.model.config import BertConfig

# Buffers and tied copies that HF writes but that carry no weights of their own.
IGNORED_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids", "cls.predictions.decoder.weight",
                "cls.predictions.decoder.bias")
# Keys under the "bert." prefix in task models; the heads ("cls.", "classifier.", "qa_outputs.") are not.
_HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")


def _load_safetensors(path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors (gs:// read whole through epath: safetensors' `load_file` is local only); a cut
    or damaged file is a ValueError naming it."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path)) if "://" not in str(path) else load(epath.Path(path).read_bytes())
    except SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error}); a cut download? fetch it again") \
            from None


def read_state_dict(directory: str) -> dict[str, np.ndarray]:
    """All tensors of an HF model directory: model.safetensors (single or sharded), else pytorch_model.bin."""
    path = epath.Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"HF model directory {directory} does not exist")
    if (path / "model.safetensors").exists():
        return _load_safetensors(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.exists():
        tensors = {}
        for shard in sorted(set(_index_entries(index))):
            tensors.update(_load_safetensors(_shard_path(path, index, shard)))
        return tensors
    if (path / "pytorch_model.bin").exists():
        try:
            import torch
        except ImportError:
            raise ValueError(f"{directory}/pytorch_model.bin needs torch to read; install torch or convert the "
                             "directory to safetensors") from None
        # weights_only=True: tensors only, no pickled code is executed.
        try:
            state = torch.load(str(path / "pytorch_model.bin"), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise ValueError(f"{directory}/pytorch_model.bin holds more than tensors (pickled objects or code); "
                             "bertjax never unpickles code: convert the model to safetensors with the tool that "
                             "wrote it, from a source you trust") from None
        return {k: v.float().numpy() for k, v in state.items()}
    raise FileNotFoundError(f"{directory} holds no model.safetensors, model.safetensors.index.json or "
                            "pytorch_model.bin")


def _index_entries(index: epath.Path) -> list[str]:
    """The shard file names a model.safetensors.index.json maps tensors to."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, TypeError, KeyError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: expected a JSON object whose \"weight_map\" maps tensor names to shard file "
                         "names")
    return list(weight_map.values())


def _shard_path(directory: epath.Path, index: epath.Path, entry: str) -> epath.Path:
    """The shard file an index entry names, which must be in the model directory: an absolute name, `..` or a
    symlink out of it would read any file the user can read (a downloaded index is not trusted). The one link out
    allowed is the hub cache's own, from `snapshots/<revision>/` into the repository's `blobs/`."""
    outside = entry.startswith(("/", "\\")) or "://" in entry or ".." in entry.replace("\\", "/").split("/")
    shard = directory / entry
    if not outside and "://" not in str(directory):
        root = os.path.realpath(directory)
        roots = [root] + ([os.path.join(os.path.dirname(os.path.dirname(root)), "blobs")]
                          if os.path.basename(os.path.dirname(root)) == "snapshots" else [])
        target = os.path.realpath(shard)
        outside = not any(os.path.commonpath([allowed, target]) == allowed for allowed in roots)
    if outside:
        raise ValueError(f"{index}: entry {entry!r} names a file outside the model directory {directory}; shards "
                         "must be files in it")
    return shard


def normalize_keys(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF keys in the table's naming: no "bert." prefix on encoder keys; old gamma/beta LayerNorm names."""
    out = {}
    for key, value in state.items():
        if key.startswith("bert."):
            key = key[len("bert."):]
        if ".LayerNorm." in key:
            key = key.replace(".LayerNorm.gamma", ".LayerNorm.weight").replace(".LayerNorm.beta", ".LayerNorm.bias")
        out[key] = value
    return out


def load_hf(directory: str):
    """(params, config, vocab tokens, lower_case) from an HF BERT directory."""
    path = epath.Path(directory)
    config = BertConfig.from_json_file(str(path / "config.json"))
    tensors = normalize_keys(read_state_dict(directory))
    params = convert.params_from_tensors(tensors, config, "hf", origin=directory, config_name="config.json",
                                         ignored=IGNORED_KEYS)
    vocab = read_vocab_file(str(path / "vocab.txt"))
    return params, config, vocab, hf_lower_case(directory)


def hf_lower_case(directory: str) -> bool:
    """Whether an HF directory's tokenizer lower-cases (tokenizer_config.json's do_lower_case; BERT's default)."""
    tokenizer_config = epath.Path(directory) / "tokenizer_config.json"
    if tokenizer_config.exists():
        return bool(json.loads(tokenizer_config.read_text()).get("do_lower_case", True))
    return True


# config.json's key for a span model's SQuAD settings (bertjax's own; transformers keeps and ignores it).
SQUAD_KEY = "squad_settings"
FINE_TUNED_HEADS = ("BertForSequenceClassification", "BertForTokenClassification", "BertForMultipleChoice",
                    "BertForQuestionAnswering")


def hf_head(directory: str) -> dict | None:
    """A fine-tuned HF directory's head: {"architecture"} plus its "id2label" where the class has labels (None for
    an encoder or a pretraining model)."""
    config = json.loads((epath.Path(directory) / "config.json").read_text())
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in FINE_TUNED_HEADS:
        return None
    head = {"architecture": architecture}
    if architecture in FINE_TUNED_HEADS[:2] and config.get("id2label"):
        head["id2label"] = {str(k): v for k, v in config["id2label"].items()}
    if architecture == "BertForSequenceClassification" and config.get("problem_type"):
        head["problem_type"] = config["problem_type"]
    if architecture == "BertForQuestionAnswering" and config.get(SQUAD_KEY):
        head["squad"] = config[SQUAD_KEY]
    return head


def hf_num_labels(directory: str) -> int | None:
    """config.json's num_labels, where it says one (transformers derives it from id2label and may leave it out)."""
    value = json.loads((epath.Path(directory) / "config.json").read_text()).get("num_labels")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _architecture(params: Mapping) -> str:
    groups = convert.held_groups(params)
    if "classifier" in groups:
        # HF's token classifier has no pooler; its sequence classifier always has one.
        return "BertForSequenceClassification" if "pooler" in groups else "BertForTokenClassification"
    if "qa_outputs" in groups:
        return "BertForQuestionAnswering"
    if {"mlm", "nsp"} <= groups:
        return "BertForPreTraining"
    if "mlm" in groups:
        return "BertForMaskedLM"
    return "BertModel"


def export_hf(params: Mapping, config: BertConfig, vocab: list[str], out_dir: str, lower_case: bool = True,
              architecture: str | None = None, id2label: dict[int, str] | None = None,
              problem_type: str | None = None, squad: dict | None = None) -> str:
    """Writes an HF directory for `params`; returns the architecture written (inferred from the heads held).
    `problem_type` (a sequence classifier's; default regression for one output, else single-label) tells
    transformers' pipeline which activation the scores take (multi-label: sigmoid). `squad`: a span model's SQuAD
    settings (version, windows, decoding), kept in config.json as `squad_settings` (transformers ignores the key)
    so that `bertjax predict` on the export decodes as the run did."""
    architecture = architecture or _architecture(params)
    tensors = convert.tensors_from_params(params, config, "hf")
    # Not part of any HF BERT architecture: kept out of model.safetensors (no unexpected keys on load).
    sbo = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("span_boundary.")]}
    if architecture != "BertModel":
        tensors = {(k if k.startswith(_HEAD_PREFIXES) else "bert." + k): v for k, v in tensors.items()}
    if "cls.predictions.bias" in tensors:
        # HF ties these to the embeddings / bias on load; writing them keeps older transformers happy too.
        tensors["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"]
        tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"]
    extra = {}
    if "classifier" in params and architecture != "BertForMultipleChoice":  # its one output is not a label
        num_labels = int(np.shape(params["classifier"]["bias"])[0])
        labels = id2label or {i: f"LABEL_{i}" for i in range(num_labels)}
        extra = dict(num_labels=num_labels, id2label={str(i): l for i, l in labels.items()},
                     label2id={l: i for i, l in labels.items()})
        if architecture == "BertForSequenceClassification":
            extra["problem_type"] = problem_type or (
                "regression" if num_labels == 1 else "single_label_classification")
    if squad and architecture == "BertForQuestionAnswering":
        extra[SQUAD_KEY] = dict(squad)
    files = _hf_files(tensors, sbo, config.to_hf_dict(architecture, **extra), vocab, lower_case,
                      config.max_position_embeddings)
    out = epath.Path(out_dir)
    if str(out).startswith("gs://") or out.exists():
        _write_files(files, out)  # in place, config.json last: unfinished, it is no model transformers loads
    else:  # beside it, then one rename: a killed export leaves nothing at out_dir
        partial = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            _write_files(files, partial)
            partial.rename(out)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return architecture


def _hf_files(tensors: dict, sbo: dict, hf_config: dict, vocab: list[str], lower_case: bool,
              max_positions: int) -> list[tuple[str, object]]:
    """(file name, what to write) of an HF directory, config.json last (what makes it a model to transformers)."""
    tokenizer_config = {"tokenizer_class": "BertTokenizer", "do_lower_case": lower_case,
                        "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                        "mask_token": "[MASK]", "model_max_length": max_positions}
    special = {k: tokenizer_config[k] for k in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")}
    files = [("model.safetensors", tensors)] + ([(names_lib.SBO_FILE, sbo)] if sbo else [])
    return files + [("vocab.txt", "".join(t + "\n" for t in vocab)),
                    ("tokenizer_config.json", json.dumps(tokenizer_config, indent=2)),
                    ("special_tokens_map.json", json.dumps(special, indent=2)),
                    ("config.json", json.dumps(hf_config, indent=2))]


def _write_files(files: list[tuple[str, object]], out: epath.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files:
        if isinstance(content, dict):  # tensors; tied ones share memory in numpy views, stored separately
            # As bytes through epath, which writes gs:// too (safetensors' save_file writes local files only, and
            # with mode 0600 where an exported model is meant to be shared like the JSON beside it).
            (out / name).write_bytes(save({k: np.ascontiguousarray(v).copy() for k, v in content.items()},
                                          metadata={"format": "pt"}))
        else:
            (out / name).write_text(content, encoding="utf-8")
