"""Each option is defined once: the pretraining config keys, `--set` parsing and the `data create` / `finetune`
flags all come from the config classes' fields."""
import dataclasses
import json

import pytest

from bertjax import options
from bertjax.cli import build_parser
from bertjax.data.cli import data_config_from_flags
from bertjax.data.data_config import PretrainingDataConfig
from bertjax.finetune.settings import SquadSettings, TrainSettings
from bertjax.model.config import BertConfig
from bertjax.model.modernbert_config import ModernBertConfig
from bertjax.model.model_options import ModelOptions
from bertjax.pretraining import config as pretrain_config


def test_job_keys_are_the_config_classes_fields():
    config = pretrain_config.default_config()
    assert set(config.data) == {f.name for f in dataclasses.fields(PretrainingDataConfig)}
    # model.* = a preset plus every BertConfig field, with BertConfig's own defaults for those a preset leaves, and
    # ModernBERT's own fields under model.modernbert (its layer pattern as global_attn_every_n_layers).
    assert set(config.model) == {"preset", "modernbert"} | {f.name for f in dataclasses.fields(BertConfig)}
    assert config.model.dtype == BertConfig.dtype and config.model.hidden_act == BertConfig.hidden_act
    modern = {f.name for f in dataclasses.fields(ModernBertConfig)} - {f.name for f in dataclasses.fields(BertConfig)}
    assert set(config.model.modernbert) == modern - {"layer_types", "bos_token_id", "eos_token_id", "cls_token_id",
                                                     "sep_token_id"} | {"global_attn_every_n_layers"}
    built = pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "model.num_hidden_layers=3"])
    assert built.bert_config(100) == BertConfig.preset("tiny", vocab_size=100, max_position_embeddings=128,
                                                       num_hidden_layers=3)
    assert isinstance(built.model, ModelOptions)
    modern_built = pretrain_config.load_config("modernbert-tiny", ["data.input=x", "data.vocab=v",
                                                                   "model.modernbert.global_attn_every_n_layers=2"])
    assert modern_built.bert_config(100).layer_types == ("full_attention", "sliding_attention") * 2
    with pytest.raises(ValueError, match=r"model.hidden_act \(ModernBERT's: model.modernbert.hidden_activation\) "
                                         "belong to the other family"):
        pretrain_config.load_config("modernbert-tiny", ["data.input=x", "data.vocab=v", "model.hidden_act=relu"])
    with pytest.raises(ValueError, match="model.modernbert.norm_bias belong to the other family"):
        pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "model.modernbert.norm_bias=true"])
    with pytest.raises(ValueError, match="train.nsp_loss=true: model.preset=modernbert-tiny"):
        pretrain_config.load_config("modernbert-tiny", ["data.input=x", "data.vocab=v", "train.nsp_loss=true",
                                                        "data.next_sentence_prediction=true"])


def test_overrides_parse_to_the_declared_type_even_where_the_default_is_none():
    config = pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "data.lower_case=false",
                                                       "data.num_epochs=3", "data.tfds_data_dir=/tmp/tfds"])
    assert config.data.lower_case is False and config.data.num_epochs == 3 and config.data.tfds_data_dir == "/tmp/tfds"
    with pytest.raises(ValueError, match="data.lower_case=maybe: expected a boolean"):
        pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "data.lower_case=maybe"])
    with pytest.raises(ValueError, match="checkpoint.keep=0 must be >= 1"):
        pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "checkpoint.keep=0"])


def test_data_create_flags_default_to_the_data_config():
    args = build_parser().parse_args(["data", "create", "--input", "a.txt", "--input", "b.txt", "--vocab", "v.txt",
                                      "--out", "o"])
    config = data_config_from_flags(args)
    assert config == PretrainingDataConfig(input="a.txt,b.txt", vocab="v.txt", masking="static")
    # Older spellings still work, and booleans have a --no- form.
    args = build_parser().parse_args(["data", "create", "--input", "a", "--vocab", "v", "--out", "o", "--no-nsp",
                                      "--max-predictions", "30", "--format", "wikitext", "--no-lower-case"])
    config = data_config_from_flags(args)
    assert (config.next_sentence_prediction, config.max_predictions_per_seq, config.corpus_format,
            config.lower_case) == (False, 30, "wikitext", False)


def test_finetune_flags_default_to_the_settings_with_each_jobs_recipe():
    args = build_parser().parse_args(["finetune", "squad", "--version", "2.0", "--init", "i", "--workdir", "w"])
    assert options.from_flags(SquadSettings, args) == SquadSettings(version="2.0")
    assert options.from_flags(TrainSettings, args) == TrainSettings(learning_rate=3e-5, batch_size=12, epochs=2.0)
    args = build_parser().parse_args(["finetune", "glue", "--task", "rte", "--data", "d", "--init", "i",
                                      "--workdir", "w", "--warmup-proportion", "0.2"])
    assert options.from_flags(TrainSettings, args) == TrainSettings(warmup_proportion=0.2)


def test_a_window_option_defaults_to_its_share_of_the_window():
    """A default that goes with a length follows it (`finetune ner --max-seq-length 64` was refused: the fixed
    default --doc-stride 64 did not fit its window). At the jobs' default lengths the derived values are the fixed
    ones they replace (NER 64 of 128; SQuAD 128 and 64 of 384, run_squad.py's); one given is kept, and one that does
    not fit is still refused, naming it."""
    from bertjax.finetune.settings import NerSettings

    ner = ["finetune", "ner", "--data", "d", "--init", "i", "--workdir", "w"]
    assert options.from_flags(NerSettings, build_parser().parse_args(ner)) == NerSettings(128, 64)
    assert options.from_flags(NerSettings, build_parser().parse_args([*ner, "--max-seq-length", "64"])) == \
        NerSettings(64, 32)
    assert NerSettings(max_seq_length=3).doc_stride == 1   # the shortest window: [CLS] one sub-token [SEP]
    assert options.from_flags(NerSettings, build_parser().parse_args([*ner, "--max-seq-length", "64", "--doc-stride",
                                                                      "10"])).doc_stride == 10
    with pytest.raises(ValueError, match=r"doc_stride=64 must be in \[1, max_seq_length - 2 = 62\]"):
        NerSettings(max_seq_length=64, doc_stride=64)
    squad = ["finetune", "squad", "--version", "2.0", "--init", "i", "--workdir", "w"]
    found = options.from_flags(SquadSettings, build_parser().parse_args(squad))
    assert (found.max_seq_length, found.doc_stride, found.max_query_length) == (384, 128, 64)
    found = options.from_flags(SquadSettings, build_parser().parse_args([*squad, "--max-seq-length", "64"]))
    assert (found.doc_stride, found.max_query_length) == (21, 16)   # 64 // 3, 64 // 4
    found = options.from_flags(SquadSettings, build_parser().parse_args([*squad, "--max-seq-length", "1024"]))
    assert found.max_query_length == 64   # a quarter, capped at run_squad.py's 64
    found = options.from_flags(SquadSettings, build_parser().parse_args([*squad, "--max-seq-length", "64",
                                                                         "--max-query-length", "20"]))
    assert (found.doc_stride, found.max_query_length) == (21, 20)
    assert dataclasses.asdict(found)["doc_stride"] == 21   # what a run records: the value it used


def test_every_option_shows_its_default_in_help(capsys):
    """`--help` of every command: each option ends with its default (`none` where it has none, 0 too), or says in
    its help how its default follows another option; a required option and a flag have none to show. (`finetune classify --help` showed no default for --max-seq-length: an option without help text
    printed nothing, and a default of 0 or '' was left out.)"""
    import argparse
    import re

    from bertjax.cli import walk_commands

    parser = build_parser()
    missing = []
    for path, command in walk_commands(parser):
        formatter = command._get_formatter()
        for action in command._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            shown = formatter._expand_help(action) if action.help else ""
            flag = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
            if not (action.required or flag or "(default" in shown):
                missing.append(f"bertjax {' '.join(path)} {action.option_strings[0]}: {shown!r}")
    assert not missing, "\n".join(missing)
    for argv, option, default in ((["finetune", "classify"], "--max-seq-length MAX_SEQ_LENGTH", "128"),
                                  (["finetune", "glue"], "--max-steps MAX_STEPS", "0"),
                                  (["pretrain"], "--init INIT, --init-from INIT", "none"),
                                  (["finetune", "ner"], "--doc-stride DOC_STRIDE", "half of --max-seq-length")):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--help"])
        printed = capsys.readouterr().out
        entry = printed.split(f"  {option}\n", 1)[1].split("\n  -", 1)[0]   # the option's lines, as printed
        assert f"(default: {default}" in " ".join(entry.split()), entry


# ---- ranges: every number a command line takes is checked as it is parsed, naming the flag or key -----------------

def _config_classes():
    """The config classes whose fields are options (flags, --set keys, config-file keys), nested ones included."""
    from bertjax.finetune.settings import NerSettings
    from bertjax.pretraining.config import PretrainConfig

    found, todo = [], [PretrainConfig, TrainSettings, SquadSettings, NerSettings, PretrainingDataConfig]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += [hint for hint in options._hints(cls).values() if dataclasses.is_dataclass(hint)]
    return found


def test_every_numeric_option_declares_its_range_and_every_numeric_flag_parses_by_one():
    from bertjax.cli import walk_commands

    unchecked = []
    for cls in _config_classes():
        for field in dataclasses.fields(cls):
            kind, _ = options._base_type(options._hints(cls)[field.name])
            if kind in (int, float) and not isinstance(field.metadata.get("valid"), options.Range):
                unchecked.append(f"{cls.__name__}.{field.name}")
    for path, parser in walk_commands(build_parser()):
        for action in parser._actions:
            number_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
            if action.type in (int, float) or (number_default and not isinstance(action.type, options.Range)):
                unchecked.append(f"bertjax {' '.join(path)} {action.option_strings[0]}")
    assert not unchecked, f"numeric options without a declared range: {unchecked}"


@pytest.mark.parametrize("argv, message", [
    (["embed", "--checkpoint", "c", "--input", "i.txt", "--output", "o.npy", "--batch-size", "-1"],
     "argument --batch-size: must be >= 1, got -1"),
    (["embed", "--checkpoint", "c", "--input", "i.txt", "--output", "o.npy", "--batch-size", "0"],
     "argument --batch-size: must be >= 1, got 0"),
    (["predict", "--model", "m", "--max-seq-length", "0"], "argument --max-seq-length: must be >= 3, got 0"),
    (["finetune", "classify", "--train", "t.csv", "--init", "i", "--workdir", "w", "--seed", "-1"],
     "argument --seed: must be >= 0, got -1"),
    (["finetune", "features", "--task", "rte", "--data", "d", "--init", "i", "--workdir", "w", "--seed", "-1"],
     "argument --seed: must be >= 0, got -1"),
    (["finetune", "glue", "--task", "rte", "--data", "d", "--init", "i", "--workdir", "w", "--learning-rate", "inf"],
     "argument --learning-rate: must be a finite number, got inf"),
    (["data", "create", "--input", "x", "--vocab", "v", "--out", "o", "--masked-lm-prob", "1"],
     "argument --masked-lm-prob: must be in (0, 1), got 1"),
    # Finite, but no run's: it passed parsing and failed later on the step count it gave, naming no flag.
    (["finetune", "classify", "--train", "t.csv", "--init", "i", "--workdir", "w", "--epochs", "1e30"],
     "argument --epochs: must be in (0, 100000], got 1e30"),
])
def test_a_value_out_of_its_range_is_refused_at_parsing_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_key_out_of_its_range_is_refused_naming_it_in_set_and_in_a_config_file(tmp_path, capsys):
    from bertjax.cli import main

    # 10**20 steps passed validation and ended in an OverflowError after the set-up.
    assert main(["config", "show", "bert-tiny", "--set", "train.steps=100000000000000000000"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "error: --set train.steps=100000000000000000000 must be <= 2147483647 (a 32-bit integer)")
    with pytest.raises(ValueError, match=r"--set train.seed=-1 must be >= 0"):
        pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "train.seed=-1"])
    saved = json.loads(json.dumps(pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v"])
                                  .to_dict()))
    saved["train"]["steps"] = 10**20
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"config.json: train.steps=100000000000000000000 must be <= 2147483647"):
        pretrain_config.load_config(str(tmp_path / "config.json"))
    # Constructed in Python, the class checks the same ranges.
    with pytest.raises(ValueError, match=r"eval_batch_size=0 must be >= 1"):
        TrainSettings(eval_batch_size=0)
