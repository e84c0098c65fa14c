"""Token texts and bytes beside log-probabilities: the bytes of a text's tokens add up to the text (characters split
across tokens included), on the byte-level tokenizers of SmolLM2 and Qwen2.5."""

from __future__ import annotations

import pytest

from cluster.serving.token_pieces import TokenPieces

TEXTS = ["Hello wörld — 你好 🙂 done", "def f(x):\n\treturn x ** 2  # ½", "émoji: 👩‍👩‍👧 and ünïcödé"]


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_bytes_add_up_to_the_text(smollm2_dir, text: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    pieces = TokenPieces(tokenizer)
    ids = tokenizer(text)["input_ids"]
    assert b"".join(bytes(pieces.piece(i)[1]) for i in ids).decode() == text
    for token_id in ids:
        piece_text, data = pieces.piece(token_id)
        assert piece_text == bytes(data).decode("utf-8", errors="replace")
    eos = tokenizer.eos_token_id
    assert pieces.piece(eos)[0] == tokenizer.decode([eos])  # a special token reads as itself
    assert set(pieces.pieces(ids)) == set(ids)
