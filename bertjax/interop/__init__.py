"""Checkpoint interop: our Orbax checkpoints, HF directories and Google's original TF checkpoints."""
from __future__ import annotations

from etils import epath

from bertjax.checkpoint import ModelCheckpoint, is_model_checkpoint, load_model, read_vocab_file


def detect_format(src: str) -> str:
    """"bertjax", "hf" or "tf" for a checkpoint path (a TF checkpoint is given by its prefix)."""
    path = epath.Path(src)
    if is_model_checkpoint(src):
        return "bertjax"
    if path.is_dir() and (path / "config.json").exists():
        return "hf"
    if epath.Path(src + ".index").exists():
        return "tf"
    raise FileNotFoundError(f"{src} is neither a bertjax checkpoint, an HF model directory (config.json + "
                            "weights) nor a TF checkpoint prefix (<prefix>.index)")


def load_pretrained(src: str, config_path: str | None = None, vocab_path: str | None = None) -> ModelCheckpoint:
    """Params, config and vocab from any supported checkpoint.

    A TF checkpoint takes its bert_config.json and vocab.txt from `config_path` / `vocab_path`, defaulting to
    the files beside the prefix, as Google's releases lay them out.
    """
    kind = detect_format(src)
    if kind == "bertjax":
        return load_model(src)
    if kind == "hf":
        from bertjax.interop.hf import load_hf

        params, config, vocab, lower_case = load_hf(src)
        return ModelCheckpoint(params, config, vocab, lower_case)
    from bertjax.interop.tf import load_tf

    folder = epath.Path(src).parent
    params, config = load_tf(src, config_path or str(folder / "bert_config.json"))
    vocab = read_vocab_file(vocab_path or str(folder / "vocab.txt"))
    # Google's uncased releases lower-case; cased ones say so in their directory name.
    lower_case = "cased" not in epath.Path(src).parent.name.replace("uncased", "")
    return ModelCheckpoint(params, config, vocab, lower_case)
