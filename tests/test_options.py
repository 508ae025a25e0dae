"""Each option is defined once: the pretraining config keys, `--set` parsing and the `data create` / `finetune`
flags all come from the config classes' fields."""
import dataclasses

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
