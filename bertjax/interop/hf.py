"""HuggingFace BERT and ModernBERT directories (config.json + safetensors/pytorch_model.bin + tokenizer files) <->
bertjax params.

Import accepts BertModel, BertForPreTraining, BertForMaskedLM, BertForSequenceClassification,
BertForMultipleChoice (read as a one-output classifier head), BertForTokenClassification and BertForQuestionAnswering
dumps (the classifiers hold `classifier.*`; the token classifier has no pooler), and ModernBERT's ModernBertModel,
ModernBertForMaskedLM and task models (by config.json's model_type). Export writes safetensors in the PyTorch key
layout (transformers v5 has no Flax models), loadable by `transformers.<Architecture>.from_pretrained` and
`AutoTokenizer.from_pretrained`. A SpanBERT SBO head, which HF BERT has no place for, goes to its own file beside
them (names.SBO_FILE).

A fine-tuned head's architecture is held by BERT's class name ("BertForSequenceClassification": the task); the
class written to config.json is the checkpoint's family's (`family.hf_architecture`).

Tokenizers: a directory with vocab.txt is WordPiece (BERT's); one with only tokenizer.json (ModernBERT's BPE) keeps
that file, which every job then tokenises with and every export writes back. Every export writes a tokenizer.json
(data/tokenizer_json.py: WordPiece's beside its vocab.txt), which transformers 5 builds a ModernBERT's tokenizer from
whatever class tokenizer_config.json names, so AutoTokenizer and `pipeline(model=export)` read either family whole.
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Mapping

import numpy as np
from etils import epath
from safetensors.numpy import load, load_file, save

from bertjax.checkpoint import read_vocab_file
from bertjax.data import tokenizer_json
from bertjax.data.json_tokenizer import HostJsonTokenizer, read_spec
from bertjax.data.token_layout import SPECIAL_TOKENS
from bertjax.runtime.errors import at_file
from bertjax.runtime.input_files import check_regular, read_json
from bertjax.interop import convert
from bertjax.interop import names as names_lib
from bertjax.model import family
from bertjax.model.family import ModelConfig
from bertjax.runtime.outputs import replaced_when_whole

# Buffers and tied copies that HF writes but that carry no weights of their own.
IGNORED_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids", "cls.predictions.decoder.weight",
                "cls.predictions.decoder.bias")
# Keys under the "bert." prefix in task models; the heads ("cls.", "classifier.", "qa_outputs.") are not.
_HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")
# ModernBERT: the encoder's keys, "model."-prefixed in task models and bare in a ModernBertModel.
_MODERNBERT_ENCODER_PREFIXES = ("embeddings.", "layers.", "final_norm.")


def _load_safetensors(path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors (gs:// read whole through epath: safetensors' `load_file` is local only); a cut
    or damaged file is a ValueError naming it."""
    from safetensors import SafetensorError

    check_regular(path, "a safetensors file")
    if "://" not in str(path):  # safetensors calls a file it may not read "No such file or directory"
        with at_file(path), open(path, "rb"):
            pass
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
        weight_map = read_json(index, "a safetensors index (JSON)")["weight_map"]
    except (TypeError, KeyError):
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


def normalize_keys(state: Mapping[str, np.ndarray], config: ModelConfig | None = None) -> dict[str, np.ndarray]:
    """HF keys in the table's naming: BERT's without the "bert." prefix on encoder keys and old gamma/beta LayerNorm
    names; ModernBERT's encoder keys with the task models' "model." prefix."""
    if config is not None and family.is_modernbert(config):
        return {("model." + key if key.startswith(_MODERNBERT_ENCODER_PREFIXES) else key): value
                for key, value in state.items()}
    out = {}
    for key, value in state.items():
        if key.startswith("bert."):
            key = key[len("bert."):]
        if ".LayerNorm." in key:
            key = key.replace(".LayerNorm.gamma", ".LayerNorm.weight").replace(".LayerNorm.beta", ".LayerNorm.bias")
        out[key] = value
    return out


def load_hf(directory: str):
    """(params, config, vocab tokens, lower_case, tokenizer spec or None) from an HF BERT or ModernBERT directory."""
    path = epath.Path(directory)
    config = family.config_from_json_file(str(path / "config.json"))
    tensors = normalize_keys(read_state_dict(directory), config)
    ignored = IGNORED_KEYS
    if family.is_modernbert(config):
        ignored = ("decoder.weight",) if config.tie_word_embeddings else ()
    params = convert.params_from_tensors(tensors, config, "hf", origin=directory, config_name="config.json",
                                         ignored=ignored)
    vocab, lower_case, spec = read_tokenizer(directory)
    return params, config, vocab, lower_case, spec


def read_tokenizer(directory: str) -> tuple[list[str], bool, dict | None]:
    """An HF directory's tokenizer: (tokens by id, lower_case, None) from vocab.txt (WordPiece), else (tokens by
    id, False, spec) from tokenizer.json with the special tokens its tokenizer_config.json names."""
    path = epath.Path(directory)
    if not (path / "vocab.txt").exists() and not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{directory} holds no tokenizer: neither vocab.txt (WordPiece) nor tokenizer.json")
    if (path / "vocab.txt").exists():
        return read_vocab_file(str(path / "vocab.txt")), hf_lower_case(directory), None
    spec = read_spec(path / "tokenizer.json", _json_or_empty(path / "tokenizer_config.json"),
                     _json_or_empty(path / "special_tokens_map.json"))
    return HostJsonTokenizer.from_spec(spec, str(path / "tokenizer.json")).vocab, False, spec


def _json_or_empty(path: epath.Path) -> dict:
    if not path.exists():
        return {}
    values = read_json(path, f"a tokenizer's {path.name}")
    return values if isinstance(values, dict) else {}


def hf_lower_case(directory: str) -> bool:
    """Whether an HF directory's tokenizer lower-cases (tokenizer_config.json's do_lower_case; BERT's default)."""
    tokenizer_config = epath.Path(directory) / "tokenizer_config.json"
    if tokenizer_config.exists():
        return bool(_json_or_empty(tokenizer_config).get("do_lower_case", True))
    return True


# config.json's key for a span model's SQuAD settings (bertjax's own; transformers keeps and ignores it).
SQUAD_KEY = "squad_settings"
# config.json's key for the length a fine-tuned model was trained at (bertjax's own, as SQUAD_KEY): `predict`'s default.
LENGTH_KEY = "max_seq_length"
FINE_TUNED_HEADS = ("BertForSequenceClassification", "BertForTokenClassification", "BertForMultipleChoice",
                    "BertForQuestionAnswering")


def hf_head(directory: str) -> dict | None:
    """A fine-tuned HF directory's head: {"architecture"} (by BERT's class name, whatever the family) plus its
    "id2label" where the class has labels (None for an encoder or a pretraining model)."""
    config = _json_or_empty(epath.Path(directory) / "config.json")
    architecture = family.task_architecture((config.get("architectures") or [None])[0])
    if architecture not in FINE_TUNED_HEADS:
        return None
    head = {"architecture": architecture}
    if architecture in FINE_TUNED_HEADS[:2] and config.get("id2label"):
        head["id2label"] = {str(k): v for k, v in config["id2label"].items()}
    if architecture == "BertForSequenceClassification" and config.get("problem_type"):
        head["problem_type"] = config["problem_type"]
    if architecture == "BertForQuestionAnswering" and config.get(SQUAD_KEY):
        head["squad"] = config[SQUAD_KEY]
    if isinstance(config.get(LENGTH_KEY), int):
        head["max_seq_length"] = config[LENGTH_KEY]
    return head


def hf_num_labels(directory: str) -> int | None:
    """config.json's num_labels, where it says one (transformers derives it from id2label and may leave it out)."""
    value = _json_or_empty(epath.Path(directory) / "config.json").get("num_labels")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _architecture(params: Mapping) -> str:
    """The task a param tree's heads make it (BERT's class names; a ModernBERT classifier's kind is not in its
    tensors: a sequence classifier)."""
    groups = convert.held_groups(params)
    if "head" in groups:
        return "BertForSequenceClassification" if "classifier" in groups else "BertForMaskedLM"
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


def export_hf(params: Mapping, config: ModelConfig, vocab: list[str], out_dir: str, lower_case: bool = True,
              architecture: str | None = None, id2label: dict[int, str] | None = None,
              problem_type: str | None = None, squad: dict | None = None, tokenizer: dict | None = None,
              max_seq_length: int | None = None) -> str:
    """Writes an HF directory for `params`; returns the architecture written (inferred from the heads held; given
    by BERT's class name, written as the family's). `problem_type` (a sequence classifier's; default regression for
    one output, else single-label) tells transformers' pipeline which activation the scores take (multi-label:
    sigmoid). `squad`: a span model's SQuAD settings (version, windows, decoding), kept in config.json as
    `squad_settings` (transformers ignores the key) so that `bertjax predict` on the export decodes as the run did.
    `tokenizer`: a tokenizer.json spec (json_tokenizer.py), written instead of vocab.txt. `max_seq_length`: the length
    a fine-tuned head was trained at, kept in config.json as `max_seq_length` (`bertjax predict`'s default)."""
    task = family.task_architecture(architecture) if architecture else _architecture(params)
    architecture = family.hf_architecture(config, task)
    if family.is_modernbert(config):
        return _export_modernbert(params, config, vocab, out_dir, lower_case, task, architecture, id2label,
                                  problem_type, squad, tokenizer, max_seq_length)
    tensors = convert.tensors_from_params(params, config, "hf")
    # Not part of any HF BERT architecture: kept out of model.safetensors (no unexpected keys on load).
    sbo = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("span_boundary.")]}
    if architecture != "BertModel":
        tensors = {(k if k.startswith(_HEAD_PREFIXES) else "bert." + k): v for k, v in tensors.items()}
    if "cls.predictions.bias" in tensors:
        # HF ties these to the embeddings / bias on load; writing them keeps older transformers happy too.
        tensors["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"]
        tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"]
    extra = _head_config(params, architecture, id2label, problem_type, squad, max_seq_length)
    files = [("model.safetensors", tensors)] + ([(names_lib.SBO_FILE, sbo)] if sbo else [])
    files += _tokenizer_files(vocab, lower_case, tokenizer, config.max_position_embeddings,
                              ["input_ids", "token_type_ids", "attention_mask"])
    # config.json last: what makes the directory a model to transformers.
    _write_directory(files + [("config.json", json.dumps(config.to_hf_dict(architecture, **extra), indent=2))],
                     out_dir)
    return architecture


def _head_config(params: Mapping, task: str, id2label, problem_type, squad, max_seq_length=None) -> dict:
    """config.json's keys for a fine-tuned head: labels, problem type, SQuAD settings, the length trained at."""
    extra = {}
    if "classifier" in params and task != "BertForMultipleChoice":  # its one output is not a label
        num_labels = int(np.shape(params["classifier"]["bias"])[0])
        labels = id2label or {i: f"LABEL_{i}" for i in range(num_labels)}
        extra = dict(num_labels=num_labels, id2label={str(i): l for i, l in labels.items()},
                     label2id={l: i for i, l in labels.items()})
        if task == "BertForSequenceClassification":
            extra["problem_type"] = problem_type or (
                "regression" if num_labels == 1 else "single_label_classification")
    if squad and task == "BertForQuestionAnswering":
        extra[SQUAD_KEY] = dict(squad)
    if max_seq_length:
        extra[LENGTH_KEY] = max_seq_length
    return extra


def _export_modernbert(params, config, vocab, out_dir, lower_case, task, architecture, id2label, problem_type,
                       squad, tokenizer, max_seq_length=None) -> str:
    """A ModernBERT HF directory: the encoder under "model." (bare for ModernBertModel), the prediction head, the
    decoder's bias (its weight tied, not written), a classifier; the tokenizer.json it was trained with."""
    tensors = convert.tensors_from_params(params, config, "hf")
    if architecture == "ModernBertModel":
        tensors = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    elif task == "BertForMaskedLM":
        tensors = {k: v for k, v in tensors.items() if not k.startswith("classifier.")}
    extra = _head_config(params, task, id2label, problem_type, squad, max_seq_length)
    if task == "BertForQuestionAnswering":
        extra.update(num_labels=2)  # HF's QA model's classifier has num_labels outputs: start and end
    # ModernBERT has no token types: its tokenizer gives none (as the released models' tokenizer_config.json says).
    files = [("model.safetensors", tensors)] + _tokenizer_files(vocab, lower_case, tokenizer,
                                                                config.max_position_embeddings,
                                                                ["input_ids", "attention_mask"])
    _write_directory(files + [("config.json", json.dumps(config.to_hf_dict(architecture, **extra), indent=2))],
                     out_dir)
    return architecture


def _tokenizer_files(vocab: list[str], lower_case: bool, tokenizer: dict | None, max_positions: int,
                     model_input_names: list[str]) -> list[tuple[str, str]]:
    """An export's tokenizer files, each giving the ids the checkpoint was trained with: a WordPiece vocabulary's
    vocab.txt (BertTokenizer's) and the tokenizer.json built from it; else the checkpoint's tokenizer.json (BERT's
    template set where its own post-processor lacks it) with the special tokens it names."""
    if tokenizer is None:
        return [("vocab.txt", "".join(t + "\n" for t in vocab))] + tokenizer_json.tokenizer_files(
            tokenizer_json.wordpiece_json(vocab, lower_case), SPECIAL_TOKENS,
            tokenizer_class=tokenizer_json.WORDPIECE_CLASS, model_input_names=model_input_names,
            model_max_length=max_positions, lower_case=lower_case)
    token_types = "token_type_ids" in model_input_names
    return tokenizer_json.tokenizer_files(
        tokenizer_json.with_bert_template(tokenizer["json"], tokenizer["special"], token_types), tokenizer["special"],
        tokenizer_class=tokenizer_json.JSON_CLASS, model_input_names=model_input_names, model_max_length=max_positions)


def _write_directory(files: list, out_dir: str) -> None:
    out = epath.Path(out_dir)
    if str(out).startswith("gs://") or out.exists():
        _write_files(files, out)  # in place, config.json last: unfinished, it is no model transformers loads
    else:  # beside it, then one rename: a failed or killed export leaves nothing at out_dir
        with replaced_when_whole(out_dir, directory=True) as partial:
            _write_files(files, epath.Path(partial))


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
