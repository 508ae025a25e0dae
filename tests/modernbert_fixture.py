"""A tiny ModernBERT written by transformers, for the tests: random weights perturbed (norms and biases not at their
init), a window smaller than the sentences, a global layer every third, and a byte-level BPE tokenizer.json with
ModernBERT's special tokens and template, trained on the checkout's example texts. Pytest-free."""
from __future__ import annotations

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
# Window 8 (4 tokens each side): the held-out sentences are 10-30 tokens.
TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=128, local_attention=8, global_attn_every_n_layers=3, global_rope_theta=1000.0,
            local_rope_theta=50.0)


def example_texts() -> list[str]:
    """The checkout's example sentences and review texts (what the BPE is trained on)."""
    texts = (REPO_ROOT / "examples" / "sentences.txt").read_text(encoding="utf-8").splitlines()
    for path in sorted((REPO_ROOT / "examples" / "reviews").glob("*.csv")):
        texts += path.read_text(encoding="utf-8").splitlines()
    return [t for t in texts if t.strip()]


def bpe_tokenizer(vocab_size: int = 300, texts: list[str] | None = None):
    """A byte-level BPE as ModernBERT's: [CLS] A [SEP] (B [SEP]) template, its special tokens, no token types; trained
    on `texts` (default: example_texts())."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(example_texts() if texts is None else texts, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "attention_mask"])


def hf_config(tokenizer, **overrides):
    from transformers import ModernBertConfig

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("pad", "[PAD]"), ("cls", "[CLS]"), ("sep", "[SEP]"))}
    return ModernBertConfig(**{**TINY, "pad_token_id": ids["pad"], "cls_token_id": ids["cls"],
                               "sep_token_id": ids["sep"], "bos_token_id": ids["cls"], "eos_token_id": ids["sep"],
                               **overrides})


def perturbed(model, seed: int = 0):
    """`model` with every parameter moved off its init by N(0, 0.1) noise (norm scales no longer 1, biases not 0)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


def write_masked_lm(directory, seed: int = 0, **overrides) -> pathlib.Path:
    """A ModernBertForMaskedLM directory (safetensors, config.json, tokenizer files) written by transformers."""
    import torch
    from transformers import ModernBertForMaskedLM

    tokenizer = bpe_tokenizer()
    torch.manual_seed(seed)
    model = perturbed(ModernBertForMaskedLM(hf_config(tokenizer, **overrides)), seed)
    directory = pathlib.Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
