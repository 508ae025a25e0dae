"""BertConfig: bert_config.json / HF config.json round trips and validation errors."""
import json

import pytest

from bertjax.model.bert.config import PRESETS, BertConfig


def test_reads_google_bert_config(shared_data):
    config = BertConfig.from_json_file(str(shared_data / "bert/uncased_L-4_H-256_A-4/bert_config.json"))
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (4, 256, 4)
    assert config.intermediate_size == 1024 and config.vocab_size == 30522 and config.hidden_act == "gelu"
    assert config == BertConfig.preset("mini")


def test_reads_hf_config(minilm_dir):
    config = BertConfig.from_json_file(str(minilm_dir / "config.json"))
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (6, 384, 12)
    assert config.layer_norm_eps == 1e-12


def test_json_round_trips(tmp_path):
    config = BertConfig.preset("small", hidden_act="gelu_new", dtype="bfloat16")
    config.to_json_file(str(tmp_path / "c.json"))
    assert BertConfig.from_json_file(str(tmp_path / "c.json")) == config
    google = config.to_bert_config_dict()
    (tmp_path / "bert_config.json").write_text(json.dumps(google))
    assert BertConfig.from_json_file(str(tmp_path / "bert_config.json")) == config.replace(dtype="float32")
    hf = config.to_hf_dict()
    assert BertConfig.from_hf_dict(hf) == config.replace(dtype="float32")


@pytest.mark.parametrize("name,expected", [("tiny", (2, 128, 2)), ("base", (12, 768, 12)), ("large", (24, 1024, 16))])
def test_presets(name, expected):
    config = BertConfig.preset(name)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == expected
    assert config.intermediate_size == 4 * config.hidden_size
    assert set(PRESETS) == {"tiny", "mini", "small", "medium", "base", "large"}


@pytest.mark.parametrize("changes,message", [
    (dict(hidden_size=100, num_attention_heads=3), "not divisible by num_attention_heads"),
    (dict(hidden_act="gelu_bogus"), "unknown hidden_act 'gelu_bogus'"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(dtype="float8"), "unknown dtype"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob must be in [0, 1)"),
    (dict(attention_backend="magic"), "unknown attention_backend"),
])
def test_invalid_configs_name_the_field(changes, message):
    with pytest.raises(ValueError, match=None) as error:
        BertConfig(**changes)
    assert message in str(error.value)


def test_bad_files(tmp_path):
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 128}))
    with pytest.raises(ValueError, match="missing keys"):
        BertConfig.from_json_file(str(tmp_path / "partial.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        BertConfig.from_json_file(str(tmp_path / "broken.json"))
    with pytest.raises(FileNotFoundError):
        BertConfig.from_json_file(str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="model_type 'roberta'"):
        BertConfig.from_hf_dict({"model_type": "roberta"})
    with pytest.raises(ValueError, match=r"unknown BertConfig keys \['bogus'\]"):
        BertConfig.from_dict({"bogus": 1})


@pytest.mark.parametrize("changes", [{}, {"num_hidden_layers": 3, "vocab_size": 97, "intermediate_size": 40},
                                     {"hidden_size": 96, "num_attention_heads": 3, "max_position_embeddings": 33}])
def test_param_count_is_the_models(changes):
    """The closed-form count the memory check uses is the parameter count of the model Flax builds."""
    import flax.linen as nn
    import jax
    import numpy as np

    from bertjax.model.bert import model as model_lib

    config = BertConfig.preset("tiny", **changes)
    shapes = jax.eval_shape(lambda: model_lib.init_params(model_lib.BertForPreTraining(config), config,
                                                          jax.random.key(0)))
    assert config.param_count() == sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nn.meta.unbox(shapes)))


@pytest.mark.parametrize("changes, field", [({"hidden_size": 10**9}, "hidden_size=1000000000"),
                                            ({"vocab_size": 10**10}, "vocab_size=10000000000"),
                                            ({"vocab_size": 10**10, "num_hidden_layers": 10**7},
                                             "num_hidden_layers=10000000")])
def test_a_model_too_big_for_the_machine_is_refused_naming_the_field_and_the_memory(changes, field):
    """Refused on construction, with the float32 params' size and the machine's memory (nothing allocated)."""
    import os

    import dataclasses

    from bertjax.model.bert.config import _param_count  # the count test_param_count_is_the_models holds to the model

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    count = _param_count({**{f.name: f.default for f in dataclasses.fields(BertConfig)}, **changes})
    with pytest.raises(ValueError) as raised:
        BertConfig(**changes)
    message = str(raised.value)
    assert message.startswith(f"invalid BertConfig: {field}: the model's {count:,} float32 parameters alone need "
                              f"{4 * count / 2**30:,.1f} GiB, "), message
    assert message.endswith(f"more than this machine's {memory / 2**30:,.1f} GiB of memory"), message
