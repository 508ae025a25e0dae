"""Pretraining job config: presets, --set overrides with types, and errors before any compile."""
import json
import pathlib

import pytest

from bertjax.model.model_options import options_of
from bertjax.pretraining import config as pretrain_config


def test_presets_load_and_overrides_apply():
    config = pretrain_config.load_config("bert-tiny", ["train.steps=77", "optimizer.learning_rate=2e-4",
                                                   "data.input=a.txt,b.txt", "data.vocab=v.txt",
                                                   "data.whole_word_masking=true", "checkpoint.every=5"])
    assert config.train.steps == 77 and config.optimizer.learning_rate == 2e-4
    assert config.data.input == "a.txt,b.txt" and config.data.whole_word_masking is True
    assert config.model.preset == "tiny"
    for name in ("bert-base-phase1", "bert-base-phase2", "bert-large-lamb-phase1"):
        preset = pretrain_config.load_config(name, ["data.input=x", "data.vocab=v"])
        assert preset.train.steps > 1000
    assert pretrain_config.load_config("bert-base-phase2", ["data.input=x", "data.vocab=v"]).data.max_seq_length == 512


@pytest.mark.parametrize("override,message", [
    ("train.stepz=5", "train.stepz: unknown config key"),
    ("bogus.steps=5", "bogus.steps: unknown config key"),
    ("train.steps=five", "train.steps=five: expected an int"),
    ("train.steps=2.5", "expected an int, got float"),
    ("data.whole_word_masking=maybe", "expected a boolean"),
    ("train.steps", "expected KEY=VALUE"),
    # Out-of-range values that used to train (a negative learning rate made the loss rise).
    ("optimizer.learning_rate=-0.001", "learning_rate=-0.001 must be >= 0"),
    ("optimizer.b2=1.0", "b2=1.0 must be in [0, 1)"),
    ("optimizer.weight_decay=-1", "weight_decay=-1.0 must be >= 0"),
    ("model.hidden_dropout_prob=1.0", "--set model.hidden_dropout_prob=1.0 must be in [0, 1)"),
    ("optimizer.warmup_steps=2000000", "optimizer.warmup_steps=2000000 must be in [0, train.steps="),
    ("checkpoint.keep=0", "keep"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError) as error:
        pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", override])
    assert message in str(error.value)


def test_cross_field_validation():
    with pytest.raises(ValueError, match="data.input is empty"):
        pretrain_config.load_config("bert-tiny", ["data.vocab=v"])
    with pytest.raises(ValueError, match="not divisible by train.grad_accum_steps"):
        pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "train.batch_size=30",
                                               "train.grad_accum_steps=4"])
    config = pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "train.batch_size=12",
                                                    "mesh.data=8"])
    with pytest.raises(ValueError, match="12 sequences per microbatch is not divisible by the data-parallel size 8"):
        pretrain_config.validate(config, num_devices=8)
    with pytest.raises(ValueError, match="mesh: mesh data=3"):
        pretrain_config.validate(pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v",
                                                                     "mesh.data=3"]), num_devices=8)
    with pytest.raises(ValueError, match="unknown config 'bert-huge'"):
        pretrain_config.load_config("bert-huge")
    with pytest.raises(ValueError, match="exceeds model.max_position_embeddings"):
        pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v", "data.max_seq_length=256",
                                                   "data.max_predictions_per_seq=40"])


def test_a_config_with_sizes_written_out_resumes_a_run_saved_without_them():
    # A run's config.json (sizes written out) given back as --config is the same job as the preset it came from.
    preset = pretrain_config.load_config("bert-tiny", ["data.input=x", "data.vocab=v"])
    written_out = preset.with_model_sizes(vocab_size=1000)
    assert written_out.model.hidden_size == 128 and written_out.model.vocab_size == 1000
    assert written_out.bert_config(1000) == preset.bert_config(1000)
    assert pretrain_config.check_resume_config(preset.to_dict(), written_out.to_dict(), allow_changes=False,
                                               where="ckpt") == []
    bigger = written_out.to_dict()
    bigger["model"]["hidden_size"] = 256
    with pytest.raises(ValueError, match=r"model.hidden_size: 128 -> 256"):
        pretrain_config.check_resume_config(preset.to_dict(), bigger, allow_changes=False, where="ckpt")


def test_a_config_file_value_of_another_type_is_named_by_its_key(tmp_path):
    from bertjax.pretraining.config import load_config

    good = load_config("bert-tiny", ["data.input=x", "data.vocab=v"])
    written = good.to_dict()
    written["train"]["steps"] = "ten"
    (tmp_path / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config\.json: train\.steps='ten': expected an int$"):
        load_config(str(tmp_path / "config.json"))
    written["train"]["steps"], written["optimizer"]["learning_rate"] = 100, 1  # an int where a float goes is fine
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert load_config(str(tmp_path / "config.json")).optimizer.learning_rate == 1


# The presets of this checkout, by path (the installed `bertjax.configs` may be another checkout's).
PRESET_FILES = pathlib.Path(__file__).resolve().parents[1] / "configs"


def test_a_warmup_ratio_follows_the_steps(capsys):
    """A preset's warmup is a share of train.steps (optimizer.warmup_ratio), so `--set train.steps=10` alone is a
    valid run; the presets' own runs keep their published warmup; an override of warmup_steps alone asks for that
    many steps (the key set wins over the preset's ratio)."""
    from bertjax.cli import main
    from bertjax.pretraining.optim import OptimizerConfig, make_optimizer

    tiny = str(PRESET_FILES / "bert_tiny.py")
    assert main(["config", "show", tiny, "--set", "train.steps=10"]) == 0
    shown = json.loads(capsys.readouterr().out)["optimizer"]
    assert OptimizerConfig(**shown).warmup_for(10) == 1
    # Each preset's own run: the warmup its recipe publishes (bert-tiny 30 of 300; BERT 10k; phase 2 1k; LAMB 2000).
    for name, warmup in (("bert_tiny", 30), ("bert_base_phase1", 10_000), ("bert_base_phase2", 1_000),
                         ("bert_large_lamb_phase1", 2000)):
        config = pretrain_config.load_config(str(PRESET_FILES / f"{name}.py"), ["data.input=x", "data.vocab=v"])
        assert config.optimizer.warmup_for(config.train.steps) == warmup, name
    fixed = pretrain_config.load_config(tiny, ["data.input=x", "train.steps=10", "optimizer.warmup_steps=3"])
    assert (fixed.optimizer.warmup_ratio, fixed.optimizer.warmup_for(10)) == (0.0, 3)
    assert main(["config", "show", tiny, "--set", "train.steps=10", "--set", "optimizer.warmup_steps=30"]) == 2
    assert "optimizer.warmup_steps=30 must be in [0, train.steps=10] (or set optimizer.warmup_ratio" in \
        capsys.readouterr().err
    # 8 steps at ratio 0.25: 2 warmup steps, then linear decay to 0 at step 8 (hand-computed).
    _, schedule = make_optimizer(OptimizerConfig(learning_rate=1.0, warmup_steps=10_000, warmup_ratio=0.25), 8)
    assert [float(schedule(s)) for s in (0, 1, 2, 5, 8)] == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match=r"warmup_ratio=1.5 must be in \[0, 1\]"):
        OptimizerConfig(warmup_ratio=1.5)


def test_both_warmup_keys_set_are_refused_or_said_never_silent(tmp_path, capsys):
    """`--set optimizer.warmup_steps=... --set optimizer.warmup_ratio=...`: the ratio replaced the steps silently.
    Both set on the command line are refused naming both; a config file holding both (as a run's config.json of a
    preset with warmup steps and a --set ratio does) gives the note a run prints, which key applies."""
    tiny = str(PRESET_FILES / "bert_tiny.py")
    with pytest.raises(ValueError, match=r"^optimizer.warmup_steps=5 and optimizer.warmup_ratio=0.2 are both set "
                                         r"\(--set\): a ratio replaces the steps; set one of them$"):
        pretrain_config.load_config(tiny, ["data.input=x", "optimizer.warmup_steps=5", "optimizer.warmup_ratio=0.2"])
    zeroed = pretrain_config.load_config(tiny, ["data.input=x", "optimizer.warmup_steps=5",
                                                "optimizer.warmup_ratio=0"])  # a ratio of 0 sets nothing
    assert zeroed.optimizer.warmup_for(300) == 5 and not zeroed.optimizer.sets_both_warmups()
    base = pretrain_config.load_config(str(PRESET_FILES / "modernbert_base.py"),
                                       ["data.input=x", "optimizer.warmup_ratio=0.1"])
    assert base.optimizer.sets_both_warmups() and base.optimizer.warmup_note(1000) == (
        "optimizer.warmup_ratio=0.1 applies: 100 warmup steps of train.steps=1,000; optimizer.warmup_steps=636 is "
        "not used")
    assert not pretrain_config.load_config(tiny, ["data.input=x"]).optimizer.sets_both_warmups()
    # `pretrain` says it before its run (here one that stops at its missing input, right after).
    from bertjax.cli import main

    assert main(["pretrain", "--config", "modernbert-base", "--workdir", str(tmp_path / "run"), "--set",
                 f"data.input={tmp_path / 'none.txt'}", "--set", "optimizer.warmup_ratio=0.1"]) == 2
    assert "note: optimizer.warmup_ratio=0.1 applies: 36,400 warmup steps of train.steps=364,000; " \
        "optimizer.warmup_steps=636 is not used" in capsys.readouterr().out


def _modernbert_checkpoint(global_theta: float):
    """A ModernBERT checkpoint's description as --init gives it (no weights needed): tiny sizes, a 300-token
    vocabulary, the global RoPE theta given."""
    from bertjax.checkpoint import ModelCheckpoint
    from bertjax.model.modernbert_config import ModernBertConfig

    config = ModernBertConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=2, local_attention=32, global_rope_theta=global_theta,
                              hidden_activation="gelu", pad_token_id=0, cls_token_id=1, sep_token_id=2,
                              bos_token_id=1, eos_token_id=2)
    return ModelCheckpoint(params={}, config=config, vocab=[f"t{i}" for i in range(300)], lower_case=False)


def test_modernberts_three_phases_chain_by_init_at_its_figures():
    """modernbert-base -> -context -> -decay (ModernBERT's released yamls): the same 4,718,592 tokens a step, phase
    1's RoPE theta 10,000 raised to 160,000 over the phase-1 checkpoint's by the context extension (the one model key
    its recipe sets over an --init checkpoint, named when it starts), every other model setting the checkpoint's;
    the decay keeps the checkpoint's model as it is; both phases continue the optimizer state, restart the schedule
    and warm up no more. 50,368 vocabulary rows without --init."""
    files = {name: str(PRESET_FILES / f"modernbert_base{suffix}.py")
             for name, suffix in (("pretrain", ""), ("context", "_context"), ("decay", "_decay"))}
    data = ["data.input=x", "data.vocab=v"]
    pretrain, context, decay = (pretrain_config.load_config(files[n], data) for n in ("pretrain", "context", "decay"))
    for config in (pretrain, context, decay):
        assert config.train.batch_size * config.data.max_seq_length == 4_718_592 and config.model.vocab_size == 50_368
    assert (pretrain.model.modernbert.global_rope_theta, pretrain.model.modernbert.local_rope_theta) == (1e4, 1e4)
    assert (context.data.max_seq_length, context.data.max_predictions_per_seq, context.train.steps) == (8192, 2458,
                                                                                                        52_982)
    assert (context.optimizer.learning_rate, context.optimizer.decay, context.optimizer.warmup_for(52_982)) == (
        3e-4, "constant", 0)
    assert (decay.train.steps, decay.optimizer.decay, decay.optimizer.warmup_for(10_597)) == (10_597, "1-sqrt", 0)
    assert context.init_optimizer_state and decay.init_optimizer_state and context.reset_schedule
    assert pretrain.train.batch_size_warmup_tokens == 50e9
    assert context.train.batch_size_warmup_tokens == decay.train.batch_size_warmup_tokens == 0
    # 250B and 50B tokens, as the yamls' max_duration, in whole steps
    assert 52_981 * 4_718_592 < 250e9 <= 52_982 * 4_718_592 and 10_596 * 4_718_592 < 50e9 <= 10_597 * 4_718_592

    phase1 = _modernbert_checkpoint(global_theta=1e4)
    extended = pretrain_config.load_config(files["context"], data, init=phase1)
    theirs = options_of(phase1.config)
    ours = options_of(extended.bert_config(300))
    assert ours["modernbert.global_rope_theta"] == 160_000.0 and ours["modernbert.local_rope_theta"] == 1e4
    assert {k: v for k, v in ours.items() if k != "modernbert.global_rope_theta"} == {
        k: v for k, v in theirs.items() if k != "modernbert.global_rope_theta"}
    assert pretrain_config.recipe_over_init(extended, phase1) == [
        "model.modernbert.global_rope_theta=160000.0 (the --init checkpoint's: 10000.0)"]
    # --set still wins; the decay (and any recipe without model_over_init) takes the checkpoint's theta
    assert pretrain_config.load_config(files["context"], [*data, "model.modernbert.global_rope_theta=5e5"],
                                       init=phase1).model.modernbert.global_rope_theta == 5e5
    for theta in (160_000.0, 1e4):
        decayed = pretrain_config.load_config(files["decay"], data, init=_modernbert_checkpoint(theta))
        assert decayed.model.modernbert.global_rope_theta == theta and decayed.model.hidden_size == 64
        assert pretrain_config.recipe_over_init(decayed, phase1) == []
    with pytest.raises(ValueError, match=r"model_over_init: model\.modernbert\.global_rope: unknown config key \(did "
                                         r"you mean model\.modernbert\.global_rope_theta\?\)"):
        pretrain_config.load_config(files["context"], [*data, "model_over_init=modernbert.global_rope"])
