"""A pretraining input resolved once: what `data.input` (or `data.eval_input`) points at and how it is read.

`resolve` decides the kind (the TFRecord shards of `data create`, or text: corpus files, hf:, tfds:), finds the
files (a shard directory as its metadata lists it; an unfinished shard set refused, naming it), resolves a corpus's
format as `data create` and `vocab train` do (format_detect.resolve: detected and said, or checked), takes the shapes
and vocabulary `data create` recorded in the shards' metadata, and checks the shards against the config. The job
calls it once per input; the pipeline reads what it found.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import tensorflow as tf

from bertjax.runtime.console import Console
from bertjax.runtime.errors import at_file
from bertjax.data import corpus, format_detect, tfrecord
from bertjax.data.data_config import PretrainingDataConfig

# What `data create` metadata written before these keys existed means: unpacked, token-masked records.
_OLDER_FEATURE_SPEC = {"instances_per_row": None, "masking_scheme": "token"}
# The data keys whose values TFRecord shards define (their metadata's, whatever the config says).
SHARD_SHAPE_KEYS = ("max_seq_length", "max_predictions_per_seq", "packing", "max_instances_per_row",
                    "masking_scheme", "next_sentence_prediction")


@dataclasses.dataclass(frozen=True)
class InputSource:
    """What a job reads: the data config with its input kind decided (and, for shards, their shapes and
    vocabulary), and every file of the input (shards, or corpus files; none for tfds:)."""

    config: PretrainingDataConfig
    files: tuple[str, ...]
    # Each corpus file's format (corpus.file_formats), in the order of `files`; none for shards and tfds:.
    formats: tuple[str, ...] = ()


def resolve(config: PretrainingDataConfig, key: str = "data.input",
            log: Callable[[str], None] | None = None) -> InputSource:
    """The input of `config` resolved: kind `auto` is TFRecords for `data create` output, else text; an explicit
    kind the files contradict, shards whose metadata disagree with the config, and an unfinished shard set are
    errors naming `key` (data.input or data.eval_input) or the file. Text input's corpus format `auto` is detected
    (said through `log`, default the console). TFRecord input without data.vocab takes the vocabulary `data create`
    recorded (when still readable)."""
    config.require_input()
    found = tfrecord.detect_kind(config.inputs)
    kind = found if config.input_kind == "auto" else config.input_kind
    if kind != found and not config.is_tfds:
        raise ValueError(f"{key}={config.input!r} holds {found} files, but data.input_kind={config.input_kind}: "
                         f"set data.input_kind=auto (or {found})")
    config = config.replace(input_kind=kind)
    if kind == "text":
        config.require_input()
        config = format_detect.resolve(config, log or Console().line, "data.corpus_format")
        if key == "data.input" and (note := config.masking_note(config.max_seq_length)):  # once, not per input
            (log or Console().line)(note)
        formats = {} if config.is_tfds else corpus.file_formats(config)
        return InputSource(config, tuple(formats), tuple(formats.values()))
    files = tfrecord.find_shards(config.inputs)
    metadata = [entry for directory in sorted({os.path.dirname(f) for f in files})
                for entry in tfrecord.read_metadata(directory)]
    config = _shapes_from_metadata(config, [meta for _, meta in metadata])
    if not config.vocab:
        recorded = [meta.get("config", {}).get("vocab") for _, meta in metadata]
        readable = [v for v in recorded if v and _exists(v)]
        if readable:
            config = config.replace(vocab=readable[0])
    _check_shapes(config, metadata)
    return InputSource(config, tuple(files))


def _exists(path: str) -> bool:
    with at_file(path):
        return tf.io.gfile.exists(path)


def check_set_keys(config: PretrainingDataConfig, set_keys, key: str = "data.input") -> None:
    """Shards define their shapes (`_shapes_from_metadata`): a preset's data.max_seq_length gives way to theirs, and
    the run says so. A value the user set (`set_keys`: the dotted keys of `--set`) is not replaced: shards of another
    shape are refused, naming the key, both values and the way out (shards holding 64 tokens, 128 asked for)."""
    asked = [name for name in SHARD_SHAPE_KEYS if f"data.{name}" in set_keys]
    if not asked or not config.inputs or config.is_tfds or tfrecord.detect_kind(config.inputs) != "tfrecord":
        return
    taken = resolve(config, key, log=lambda line: None).config
    differ = [name for name in asked if getattr(taken, name) != getattr(config, name)]
    if differ:
        said = ", ".join(f"data.{name}={getattr(config, name)}" for name in differ)
        held = ", ".join(f"{name}={getattr(taken, name)}" for name in differ)
        raise ValueError(f"{said} is set (--set), but the shards of {key}={config.input!r} hold {held}: shards "
                         f"define their shapes; drop the --set to train on them as they are, or make shards of the "
                         f"shape you want (data create)")


def _shapes_from_metadata(config: PretrainingDataConfig, metadata: list[dict]) -> PretrainingDataConfig:
    """The config with the shapes `data create` recorded for its TFRecords (sequence length, predictions per
    sequence, packing, masking scheme, whether NSP pairs were made): shards define their own. Shards whose
    metadata disagree, or TFRecords without metadata, keep the config's values (checked by `_check_shapes`)."""
    specs = {json.dumps({**_OLDER_FEATURE_SPEC, **meta.get("feature_spec", {}), "next_sentence_prediction":
                         meta.get("config", {}).get("next_sentence_prediction", True)}, sort_keys=True)
             for meta in metadata}
    if len(specs) != 1:
        return config
    spec = json.loads(specs.pop())
    changes = {key: spec[key] for key in ("max_seq_length", "max_predictions_per_seq", "masking_scheme",
                                          "next_sentence_prediction") if key in spec}
    changes["packing"] = spec["instances_per_row"] is not None
    if spec["instances_per_row"] is not None:
        changes["max_instances_per_row"] = spec["instances_per_row"]
    return config.replace(**changes)


def _check_shapes(config: PretrainingDataConfig, metadata: list[tuple[str, dict]]) -> None:
    """Shapes must match what `data create` wrote (every metadata file beside the shards, however they were
    named: a directory, a glob or files)."""
    wanted = tfrecord.feature_spec_metadata(config)
    for meta_path, meta in metadata:
        written = {**_OLDER_FEATURE_SPEC, **meta.get("feature_spec", {})}
        for key, value in wanted.items():
            if key in written and written[key] != value:
                hint = ""
                if key == "instances_per_row":  # None = unpacked rows
                    hint = (f" (set data.packing=true, data.max_instances_per_row={written[key]})"
                            if written[key] else " (they are unpacked: set data.packing=false)")
                if key == "masking_scheme":
                    hint = f" (set data.masking_scheme={written[key]})"
                raise ValueError(f"{meta_path}: the shards hold examples with {key}={written[key]}, the "
                                 f"pipeline asks for {value}{hint}")
