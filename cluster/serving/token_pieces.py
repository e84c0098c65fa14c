"""Tokens as a client reads them beside their log-probabilities: each id's text and its bytes (OpenAI's `token` and
`bytes`), computed where the tokenizer is (the scheduler) and sent with the chunk.

A token's bytes are what it adds to the output: a byte-level BPE token (GPT-2's alphabet: SmolLM2, Qwen2.5) maps each
character back to its byte; a SentencePiece byte token `<0xNN>` is that byte; any other token is its decode's UTF-8.
Its text is those bytes decoded, a partial character shown as U+FFFD (as vLLM shows it), so the texts of tokens that
split a character do not add up to the output's text, while their bytes do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of its bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


class TokenPieces:
    """A tokenizer's id -> (text, bytes), remembered per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._pieces: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._byte_level = _byte_level(tokenizer)

    def piece(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        found = self._pieces.get(token_id)
        if found is None:
            data = self._bytes(token_id)
            found = self._pieces[token_id] = (data.decode("utf-8", errors="replace"), tuple(data))
        return found

    def pieces(self, ids: Iterable[int]) -> dict[int, tuple[str, tuple[int, ...]]]:
        return {token_id: self.piece(token_id) for token_id in set(ids)}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token adds to a decode, not remembered (cluster/serving/prompt_tokens.py reads them all)."""
        return self._bytes(token_id)

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._special:  # shown as itself (its text is not in the output)
            return self._tokenizer.decode([token_id]).encode()
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            return b""
        decoder = _byte_decoder()
        if self._byte_level and token and all(char in decoder for char in token):
            return bytes(decoder[char] for char in token)
        match = _BYTE_TOKEN.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return self._tokenizer.decode([token_id]).encode()


def _byte_level(tokenizer: Any) -> bool:
    """The tokenizer's decoder is byte-level BPE (its tokens are GPT-2 alphabet strings)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)
