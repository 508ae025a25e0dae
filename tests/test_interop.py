"""HF / TF checkpoint interop against transformers (PyTorch) as the independent reference."""
import csv

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from bertjax.checkpoint import load_model, save_model
from bertjax.cli import main as cli
from bertjax.interop.load import load_pretrained
from bertjax.interop.tf import write_tf_checkpoint
from bertjax.model import bert as model_lib
from bertjax.model.config import BertConfig

BUILTIN_SENTENCES = [
    "Short.",
    "The film works.",
    "A quiet, patient drama.",
    "It never quite finds its rhythm.",
    "the movie was a delight from start to finish .",
    "A gripping, beautifully shot thriller that never lets go.",
    "I wanted to like it, but the plot made no sense whatsoever.",
    "Its best moments come when the two leads simply talk to each other about nothing in particular.",
    "Even at two hours, the story feels rushed, as if whole scenes had been cut at the last minute.",
    "What begins as a light comedy about a family reunion slowly turns into something darker and far more "
    "interesting than its trailer suggests.",
    "The soundtrack is wonderful.",
    "Nobody in the cast seems to know what film they are in, and the director does not help them.",
    "An honest, funny and moving portrait of growing up in a small town where everyone knows your name.",
    "Dull.",
    "Visually stunning yet emotionally empty, it is a film to admire rather than to love.",
    "If you liked the first one, you will probably enjoy this sequel, although it adds very little that is new, "
    "and its jokes are recycled from better movies of the same kind.",
] * 4


def _sst2_dev_sentences(shared_data_dir, count=96):
    path = shared_data_dir / "glue/SST-2/dev.tsv"
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [row[0] for row in rows[1:count + 1]]


@pytest.fixture(scope="module")
def real_sentences(request):
    from tests.conftest import SHARED_DATA

    if (SHARED_DATA / "glue/SST-2/dev.tsv").exists():
        return _sst2_dev_sentences(SHARED_DATA)
    return BUILTIN_SENTENCES  # fresh clone without ../shared: still real English sentences


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return load_pretrained(str(minilm_dir))


def test_minilm_sequence_output_matches_transformers(minilm, minilm_dir, real_sentences):
    assert len(real_sentences) >= 64
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    batch = tokenizer(real_sentences, padding=True, return_tensors="np")
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths)) > 10, "sentences of different lengths exercise the padding mask"
    reference_model = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    with torch.no_grad():
        expected = reference_model(**{k: torch.from_numpy(v) for k, v in batch.items()}).last_hidden_state.numpy()
    ours, _ = model_lib.BertModel(minilm.config).apply(
        {"params": minilm.params["bert"]}, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    valid = batch["attention_mask"].astype(bool)
    assert np.abs(np.asarray(ours)[valid] - expected[valid]).max() <= 1e-4


def test_minilm_round_trip_is_bit_exact(minilm, minilm_dir, tmp_path):
    save_model(str(tmp_path / "ckpt"), minilm.params, minilm.config, minilm.vocab)
    assert cli(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    source = load_file(str(minilm_dir / "model.safetensors"))
    exported = load_file(str(tmp_path / "hf/model.safetensors"))
    source.pop("embeddings.position_ids")
    assert set(exported) == set(source)
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    assert (tmp_path / "hf/vocab.txt").read_text() == (minilm_dir / "vocab.txt").read_text()


@pytest.fixture(scope="module")
def tiny_hf_pretraining(tmp_path_factory):
    """A randomly initialised tiny transformers.BertForPreTraining saved as an HF directory."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64, hidden_act="gelu")
    reference = transformers.BertForPreTraining(config).eval()
    with torch.no_grad():  # non-trivial LayerNorm and bias values, so a swapped tensor cannot go unnoticed
        for name, param in reference.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("hf_tiny")
    reference.save_pretrained(str(path))
    (path / "vocab.txt").write_text("".join(f"[unused{i}]\n" for i in range(120)))
    return path, reference


def test_tiny_pretraining_logits_match_transformers(tiny_hf_pretraining):
    path, reference = tiny_hf_pretraining
    loaded = load_pretrained(str(path))
    assert set(loaded.params) == {"bert", "predictions", "seq_relationship"}
    rng = np.random.default_rng(1)
    input_ids = rng.integers(5, 120, (4, 24)).astype(np.int32)
    input_mask = np.ones_like(input_ids)
    input_mask[2, 15:] = 0
    segment_ids = np.zeros_like(input_ids)
    segment_ids[:, 10:] = 1
    positions = rng.integers(0, 15, (4, 5)).astype(np.int32)
    with torch.no_grad():
        out = reference(input_ids=torch.from_numpy(input_ids).long(), attention_mask=torch.from_numpy(input_mask),
                        token_type_ids=torch.from_numpy(segment_ids).long())
    expected_mlm = np.take_along_axis(out.prediction_logits.numpy(), positions[..., None], axis=1)
    ours = model_lib.BertForPreTraining(loaded.config).apply(
        {"params": loaded.params}, input_ids, input_mask, segment_ids, positions)
    np.testing.assert_allclose(np.asarray(ours["mlm_logits"]), expected_mlm, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ours["nsp_logits"]), out.seq_relationship_logits.numpy(), rtol=1e-4,
                               atol=1e-4)


def test_tiny_pretraining_round_trip_through_cli(tiny_hf_pretraining, tmp_path):
    path, reference = tiny_hf_pretraining
    assert cli(["convert", "--from", "hf", str(path), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    source = load_file(str(path / "model.safetensors"))
    exported = load_file(str(tmp_path / "hf/model.safetensors"))
    for key, value in source.items():
        assert np.array_equal(exported[key], value), key
    reloaded = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    for (name, a), (_, b) in zip(reference.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer.convert_tokens_to_ids("[unused7]") == 7


def test_tf_checkpoint_with_real_variable_names_imports(shared_data, tmp_path):
    import tensorflow as tf

    release = shared_data / "bert/uncased_L-4_H-256_A-4"
    variables = tf.train.list_variables(str(release / "bert_model.ckpt"))
    rng = np.random.default_rng(2)
    tensors = {name: rng.normal(size=shape).astype(np.float32) for name, shape in variables
               if name != "global_step"}
    # A continued-training checkpoint also carries optimizer slots and a step counter: they must be skipped.
    tensors["bert/pooler/dense/kernel/adam_m"] = np.zeros((256, 256), np.float32)
    prefix = write_tf_checkpoint(tensors, str(tmp_path / "tf/bert_model.ckpt"))
    assert {n for n, _ in tf.train.list_variables(prefix)} >= {n for n, _ in variables if n != "global_step"}

    assert cli(["convert", "--from", "tf", prefix, "--config", str(release / "bert_config.json"),
                "--vocab", str(release / "vocab.txt"), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    hf = load_file(str(tmp_path / "hf/model.safetensors"))
    # TF kernels are [in, out], PyTorch Linear weights [out, in]; seq_relationship is stored [2, H] in both.
    np.testing.assert_array_equal(hf["bert.encoder.layer.2.attention.self.query.weight"],
                                  tensors["bert/encoder/layer_2/attention/self/query/kernel"].T)
    np.testing.assert_array_equal(hf["bert.encoder.layer.3.output.LayerNorm.weight"],
                                  tensors["bert/encoder/layer_3/output/LayerNorm/gamma"])
    np.testing.assert_array_equal(hf["cls.seq_relationship.weight"],
                                  tensors["cls/seq_relationship/output_weights"])
    np.testing.assert_array_equal(hf["cls.predictions.bias"], tensors["cls/predictions/output_bias"])
    np.testing.assert_array_equal(hf["bert.embeddings.word_embeddings.weight"],
                                  tensors["bert/embeddings/word_embeddings"])
    converted = 0
    for name, value in tensors.items():
        if name.endswith("adam_m"):
            continue
        key = _hf_key_for_tf(name)
        expected = value.T if name.endswith("/kernel") else value
        np.testing.assert_array_equal(hf[key], expected, err_msg=name)
        converted += 1
    assert converted == len(variables) - sum(1 for n, _ in variables if n == "global_step")
    reloaded = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf"))
    assert reloaded.config.num_hidden_layers == 4


def _hf_key_for_tf(name: str) -> str:
    """Google TF name -> HF key, by the documented naming convention (independent of bertjax's table)."""
    key = name.replace("/", ".").replace("layer_", "layer.").replace(".gamma", ".weight").replace(".beta", ".bias")
    key = key.replace(".kernel", ".weight")
    key = key.replace("cls.predictions.output_bias", "cls.predictions.bias")
    key = key.replace("cls.seq_relationship.output_weights", "cls.seq_relationship.weight")
    key = key.replace("cls.seq_relationship.output_bias", "cls.seq_relationship.bias")
    if key.startswith("bert.embeddings.") and key.split(".")[2].endswith("embeddings"):
        key += ".weight"
    return key


def test_checkpoint_errors_name_the_tensor(tiny_hf_pretraining, tmp_path):
    from safetensors.numpy import save_file

    path, _ = tiny_hf_pretraining
    tensors = load_file(str(path / "model.safetensors"))

    def variant(name, changed):
        folder = tmp_path / name
        folder.mkdir()
        for file in ("config.json", "vocab.txt"):
            (folder / file).write_text((path / file).read_text())
        save_file(changed, str(folder / "model.safetensors"))
        return str(folder)

    missing = dict(tensors)
    missing.pop("bert.encoder.layer.1.intermediate.dense.bias")
    with pytest.raises(ValueError, match=r"/missing: tensor 'encoder.layer.1.intermediate.dense.bias' is missing "
                                         r"\(expected shape \(96,\)\)"):
        load_pretrained(variant("missing", missing))
    extra = dict(tensors, **{"bert.encoder.layer.9.output.dense.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match=r"config.json says num_hidden_layers=2 but the checkpoint holds tensor "
                                         r"encoder.layer.9.output.dense.weight \(3, 3\)"):
        load_pretrained(variant("extra", extra))
    bad_shape = dict(tensors, **{"bert.encoder.layer.0.attention.self.key.weight": np.zeros((64, 32),
                                                                                             np.float32)})
    with pytest.raises(ValueError, match=r"config.json says hidden_size=64 but tensor "
                                         r"encoder.layer.0.attention.self.key.weight has shape \(64, 32\) \(the "
                                         r"config gives \(64, 64\)\)"):
        load_pretrained(variant("shape", bad_shape))
    # A layer short: the config's layer count is named.
    short = {k: v for k, v in tensors.items() if not k.startswith("bert.encoder.layer.1.")}
    with pytest.raises(ValueError, match=r"config.json says num_hidden_layers=2 but tensor 'encoder.layer.1.\S+' is "
                                         r"missing"):
        load_pretrained(variant("short", short))


def test_vocab_size_mismatch_is_an_error(tmp_path):
    config = BertConfig.preset("tiny", vocab_size=10)
    with pytest.raises(ValueError, match="vocabulary has 3 tokens but config.vocab_size is 10"):
        save_model(str(tmp_path / "c"), {}, config, ["a", "b", "c"])


def test_checkpoint_round_trip_and_half_written_checkpoint(minilm, tmp_path):
    save_model(str(tmp_path / "ckpt"), minilm.params, minilm.config, minilm.vocab)
    restored = load_model(str(tmp_path / "ckpt"))
    assert restored.config == minilm.config and restored.vocab == minilm.vocab
    for a, b in zip(*(np.asarray(x) for x in (restored.params["bert"]["layer_3"]["output"]["kernel"],
                                               minilm.params["bert"]["layer_3"]["output"]["kernel"]))):
        assert np.array_equal(a, b)
    # A directory Orbax did not finish (no committed items) is rejected, never read as a model.
    (tmp_path / "partial.orbax-checkpoint-tmp-1").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a bertjax checkpoint"):
        load_model(str(tmp_path / "partial.orbax-checkpoint-tmp-1"))


@pytest.mark.parametrize("architecture", ["BertForSequenceClassification", "BertForTokenClassification",
                                          "BertForQuestionAnswering"])
def test_fine_tuning_heads_match_transformers_and_round_trip(architecture, tmp_path):
    torch.manual_seed(3)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32,
                                     num_labels=2 if architecture == "BertForQuestionAnswering" else 3)
    reference = getattr(transformers, architecture)(config).eval()
    reference.save_pretrained(str(tmp_path / "src"))
    (tmp_path / "src/vocab.txt").write_text("".join(f"w{i}\n" for i in range(50)))
    loaded = load_pretrained(str(tmp_path / "src"))
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 50, (2, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        out = reference(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask))
    if architecture == "BertForSequenceClassification":
        module = model_lib.BertForSequenceClassification(loaded.config, num_labels=3)
        logits = module.apply({"params": loaded.params}, ids, mask, np.zeros_like(ids))
        np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), rtol=1e-5, atol=1e-5)
    elif architecture == "BertForTokenClassification":  # no pooler: the export infers the token classifier
        assert "pooler" not in loaded.params["bert"]
        logits = model_lib.BertForTokenClassification(loaded.config, num_labels=3).apply(
            {"params": loaded.params}, ids, mask, np.zeros_like(ids))
        np.testing.assert_allclose(np.asarray(logits)[mask == 1], out.logits.numpy()[mask == 1], rtol=1e-5, atol=1e-5)
    else:
        start, end = model_lib.BertForQuestionAnswering(loaded.config).apply(
            {"params": loaded.params}, ids, mask, np.zeros_like(ids))
        np.testing.assert_allclose(np.asarray(start), out.start_logits.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(end), out.end_logits.numpy(), rtol=1e-5, atol=1e-5)
    save_model(str(tmp_path / "ckpt"), loaded.params, loaded.config, loaded.vocab)
    assert cli(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    reloaded = getattr(transformers, architecture).from_pretrained(str(tmp_path / "hf"))
    for (name, a), (_, b) in zip(reference.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


# ---- every export's tokenizer: each vocabulary kind x each family, read whole by transformers ----------------------

VOCABULARY_KINDS = {"wordpiece": "vocab.txt", "sentencepiece": "spm.model", "bpe": "tokenizer.json"}


@pytest.fixture(scope="module")
def trained_vocabularies(tmp_path_factory):
    """A vocabulary of each kind, trained by `vocab train`'s code on the demo corpus: {kind: its file}."""
    from bertjax.data.corpus import CorpusConfig
    from bertjax.data.demo_corpus import write_demo_corpus
    from bertjax.data.vocab import train_vocab

    folder = tmp_path_factory.mktemp("vocabularies")
    train_path, _ = write_demo_corpus(str(folder))
    paths = {}
    for kind, name in VOCABULARY_KINDS.items():
        trained = train_vocab(CorpusConfig(input=(train_path,)), str(folder / kind), 1000, kind, min_count=2,
                              log=lambda line: None)
        assert trained.path.endswith(name)
        paths[kind] = trained.path
    return paths


@pytest.mark.parametrize("kind", list(VOCABULARY_KINDS))
@pytest.mark.parametrize("preset", ["tiny", "modernbert-tiny"])
def test_every_export_loads_whole_in_autotokenizer_and_the_fill_mask_pipeline(trained_vocabularies, kind, preset,
                                                                               real_sentences, tmp_path):
    """A pretraining checkpoint of either family on any vocabulary, exported: AutoTokenizer gives the ids (and, for
    BERT, the token types) of the tokenizer the run trained with (data/tokenizers.load_tokenizer), singles and
    pairs, and `pipeline("fill-mask", model=export)` scores the masked word as the checkpoint's own model does."""
    import flax.linen as nn
    import jax

    from bertjax.data.tokenizers import load_tokenizer
    from bertjax.model import family
    from bertjax.model.model_options import ModelOptions, build_model_config

    trained_with = load_tokenizer(trained_vocabularies[kind])  # what `pretrain --set data.vocab=...` tokenises with
    config = build_model_config(ModelOptions(preset=preset), len(trained_with.vocab), trained_with.special_token_ids)
    model = family.pretraining_model(config)
    params = nn.meta.unbox(family.init_params(model, config, jax.random.PRNGKey(0)))
    save_model(str(tmp_path / "ckpt"), params, config, trained_with.vocab, trained_with.lower_case,
               tokenizer=getattr(trained_with, "spec", None))
    assert cli(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0

    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    bert = preset == "tiny"
    assert ("token_type_ids" in hf.model_input_names) == bert  # ModernBERT has no token types
    first, second = real_sentences[:32], real_sentences[32:64]
    for text_pairs in (None, second):
        ours = trained_with.encode(first, max_len=512, text_pairs=text_pairs)
        theirs = hf(first, text_pairs, return_token_type_ids=True)
        for row, (ids, types) in enumerate(zip(theirs["input_ids"], theirs["token_type_ids"])):
            assert len(ids) < 512 and ours["input_ids"][row, :len(ids)].tolist() == ids
            assert ours["segment_ids"][row, :len(types)].tolist() == types and ours["input_mask"][row].sum() == len(ids)

    text = f"The film is {hf.mask_token} and the story moves."
    found = transformers.pipeline("fill-mask", model=str(tmp_path / "hf"), top_k=5)(text)
    encoded = hf(text, return_tensors="np", return_token_type_ids=True)
    position = int(np.flatnonzero(encoded["input_ids"][0] == hf.mask_token_id)[0])
    logits = model.apply({"params": params}, encoded["input_ids"], encoded["attention_mask"],
                         encoded["token_type_ids"], np.array([[position]]))["mlm_logits"]
    probabilities = np.asarray(jax.nn.softmax(np.asarray(logits, np.float64).reshape(-1)[:len(trained_with.vocab)]))
    assert [r["token"] for r in found] == list(np.argsort(-probabilities)[:5])
    np.testing.assert_allclose([r["score"] for r in found], np.sort(probabilities)[::-1][:5], rtol=1e-4)
