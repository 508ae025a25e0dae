"""The encoder families' contract (bertjax/model/family.py, encoder_family.py): a family is one object registered by
HF's model_type, found from a config.json that transformers wrote; each answers for its task modules and HF class
names; and the jobs never name a family (no family's module imported, no family's class named, no `is_modernbert`)."""
import ast
import json
import pathlib

import jax
import pytest

from bertjax.model import family
from bertjax.model.encoder_family import EncoderFamily

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The jobs, readers and writers: everything of the package outside model/ (the families, their parts, the registry).
JOB_FOLDERS = ("finetune", "pretraining", "interop", "cloud", "data", "runtime")
JOB_MODULES = sorted(p for folder in JOB_FOLDERS for p in (ROOT / "bertjax" / folder).rglob("*.py")) + [
    ROOT / "bertjax" / name for name in ("checkpoint.py", "cli.py", "options.py", "sharding.py")]
FAMILY_PACKAGES = tuple(f"bertjax.model.{name}" for name in family.FAMILIES)


def family_class_names() -> set[str]:
    """The classes the families' packages define (configs, modules, family objects)."""
    names = set()
    for package in FAMILY_PACKAGES:
        for path in (ROOT / pathlib.Path(*package.split("."))).glob("*.py"):
            names |= {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    return names


def test_the_reader_of_names_sees_a_family_named(tmp_path):
    """The check below can fail: a job that imports a family's module, names its class or asks is_modernbert."""
    job = tmp_path / "job.py"
    job.write_text("from bertjax.model.modernbert.config import ModernBertConfig\n"
                   "def f(c):\n    return isinstance(c, ModernBertConfig) or family.is_modernbert(c)\n")
    assert named_families(job, family_class_names()) == [
        "imports bertjax.model.modernbert.config", "names ModernBertConfig", "names is_modernbert"]


def named_families(path: pathlib.Path, classes: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                   else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        found += [f"imports {m}" for m in modules if m.startswith(FAMILY_PACKAGES)]
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name in classes or name == "is_modernbert":
            found.append(f"names {name}")
    return found


def test_the_jobs_never_name_a_family():
    classes = family_class_names()
    assert {"BertConfig", "ModernBertConfig", "ModernBertForMaskedLM", "BertForPreTraining"} <= classes
    named = {str(p.relative_to(ROOT)): named_families(p, classes) for p in JOB_MODULES}
    assert {path: what for path, what in named.items() if what} == {}


@pytest.mark.parametrize("model_type", ["bert", "modernbert"])
def test_a_family_is_found_by_the_model_type_of_the_config_json_transformers_writes(tmp_path, model_type):
    transformers = pytest.importorskip("transformers")
    hf_config = {"bert": transformers.BertConfig, "modernbert": transformers.ModernBertConfig}[model_type](
        hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=96, vocab_size=120,
        pad_token_id=0)
    hf_config.save_pretrained(tmp_path)
    config = family.config_from_json_file(str(tmp_path / "config.json"))
    kind = family.of(config)
    assert kind is family.by_model_type(model_type) and kind.model_type == model_type == config.model_type
    assert isinstance(kind, EncoderFamily) and isinstance(config, kind.config_class)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 3, 120)
    # bertjax's own JSON (a checkpoint's) and the HF dict it writes read back as the same family and config.
    assert family.config_from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert family.config_from_hf_dict(config.to_hf_dict()) == config


def test_a_model_type_no_family_has_is_refused_naming_those_there_are():
    with pytest.raises(ValueError, match="model_type 'neobert' is neither 'bert' nor 'modernbert'"):
        family.config_from_hf_dict({"model_type": "neobert"}, source="config.json")


def test_presets_name_their_family():
    assert family.of_preset("base") is family.by_model_type("bert")
    assert family.of_preset("modernbert-tiny") is family.by_model_type("modernbert")
    assert all(family.of_preset(p) is f for f in family.FAMILIES.values() for p in f.presets)


@pytest.mark.parametrize("model_type", sorted(family.FAMILIES))
def test_every_family_answers_each_task_with_a_module_and_a_class_transformers_has(model_type):
    transformers = pytest.importorskip("transformers")
    kind = family.by_model_type(model_type)
    config = kind.shape_probe
    tasks = {"BertModel": kind.encoder(config), "BertForSequenceClassification": kind.sequence_classifier(config, 3),
             "BertForTokenClassification": kind.token_classifier(config, 3),
             "BertForQuestionAnswering": kind.question_answering(config),
             "BertForMultipleChoice": kind.multiple_choice(config),
             "BertForPreTraining": kind.pretraining_model(config)}
    for task, module in tasks.items():
        shapes = jax.eval_shape(lambda: kind.init_params(module, config, jax.random.key(0)))
        assert jax.tree_util.tree_leaves(shapes), task
        hf_class = kind.hf_architecture(task)
        assert hf_class.startswith(kind.class_prefix) and hasattr(transformers, hf_class), hf_class
        if task != "BertForPreTraining":  # ModernBERT pretrains its masked LM
            assert family.task_architecture(hf_class) == task
    assert kind.activation(config) in ("gelu", "gelu_new", "gelu_pytorch_tanh")
    flops = kind.train_flops(config, seq_len=16, real_tokens=16, masked_tokens=2, instances=1)
    assert flops > 3 * 2 * 16 * config.num_hidden_layers * config.hidden_size ** 2  # at least the q/k/v/o products
