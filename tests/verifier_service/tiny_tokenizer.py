"""A tokenizer of single characters, for constraint tests on random-weight models without any model weights:
a byte-level BPE with no merges (llguidance reads it as it reads real ones), ids 0-2 the special tokens."""

from __future__ import annotations

from functools import cache

from transformers import PreTrainedTokenizerFast

CHARS = ("a", "b", "c", "d", "e", "{", "}", '"', ":", "1", "2")
EOS = 2
VOCAB = 16  # the models' vocabulary: the tokenizer's 14 ids and two it never produces (always forbidden)


@cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": EOS}
    for char in CHARS:
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")


def ids(text: str) -> list[int]:
    return [CHARS.index(c) + 3 for c in text]
