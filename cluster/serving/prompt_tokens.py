"""A prompt's tokens, paid for only within bounds and off the scheduler's event loop (docs/api.md, "Limits").

    PromptBound    refuses, before tokenizing, a prompt too long in bytes for the context: a token stands for at most
                   `bytes_per_token` bytes of text (the vocabulary's longest token, read once at startup), so a prompt
                   of more than (max_context - max_tokens) x that many (max_tokens unset: 1) cannot fit, whatever it
                   tokenizes to
    PromptEncoder  tokenizes on threads, not on the event loop: prompts of at most SHORT_PROMPT_BYTES on one thread of
                   their own (in order), longer ones on `tokenizer_threads` threads, the shortest first; after a long
                   one the C heap's free memory goes back to the system (the tokenizer's output is not kept)

A 1 MiB prompt of CJK text is 2.4 M tokens: tokenized on the event loop it held every other request for 3 s, and the
scheduler's memory grew by 400 MiB and stayed. The bound alone does not make tokenizing cheap (SmolLM2's longest
token is 81 bytes: a 2048-token context still takes 166 kB of text, 0.2 s of CJK), the threads keep it off the loop
and away from short prompts; the tokenizer releases the GIL for most of its work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import heapq
import itertools
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from cluster.serving.token_pieces import TokenPieces
from specserve_types.api import InvalidRequestError
from specserve_types.protocol import GenerateArgs

logger = logging.getLogger("ray.serve")

SHORT_PROMPT_BYTES = 8 << 10  # a prompt this short tokenizes in about a millisecond: never behind a long one
TRIM_AFTER_BYTES = 64 << 10  # after tokenizing a prompt this long, free memory goes back to the system

# What a tokenizer's normalizer can shrink a text's bytes by (a token covers fewer bytes of the client's text than
# its own): Unicode normal forms and lower-casing at most 4x (U+1D400 MATHEMATICAL BOLD A, 4 bytes, is NFKC's "A";
# U+212A KELVIN SIGN, 3 bytes, NFC's "K"; a Hangul syllable's three jamo, 9 bytes, one 3-byte syllable), prepending
# nothing. A normalizer that can delete text (Strip, Replace with "", BERT's, SentencePiece's precompiled) has no
# such bound: the prompt then keeps only the 1 MiB bound.
SHRINKS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
# Pre-tokenizers that keep every character (Whitespace and BERT's drop the spaces: no bound)
KEEPING = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}
# Models whose every token covers at most its own bytes (WordPiece and WordLevel make one unknown token of a whole
# word: no bound; Unigram without byte fallback may too)
MODELS = {"BPE"}


def _shrink(normalizer: dict[str, Any] | None) -> float | None:
    """How many times fewer bytes a normalizer can leave of a text; None where it may delete text."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor: float = 1
        for part in normalizer.get("normalizers", ()):
            inner = _shrink(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind == "Replace":  # a string for a string (SentencePiece's " " -> "▁"): shrinks by their lengths' ratio
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        if not pattern or not content:
            return None
        return max(1.0, len(pattern.encode()) / len(content.encode()))
    return SHRINKS.get(kind)  # type: ignore[arg-type]


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(part) for part in pre_tokenizer.get("pretokenizers", ()))
    if kind == "Split" and pre_tokenizer.get("behavior") == "Removed":
        return False
    return kind in KEEPING


def bytes_per_token(tokenizer: Any) -> float | None:
    """The most bytes of a client's text one token can stand for (the vocabulary's longest token, in the bytes it
    adds to a decode, times what the normalizer can shrink a text by); None where that has no bound or the tokenizer
    is not a Hugging Face fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        shrink = _shrink(spec.get("normalizer"))
        model = spec.get("model") or {}
        if shrink is None or not _keeps_text(spec.get("pre_tokenizer")) or model.get("type") not in MODELS:
            return None
        pieces = TokenPieces(tokenizer)
        longest = max(len(pieces.token_bytes(token)) for token in range(len(tokenizer)))
    except Exception:  # a tokenizer we cannot read this way: only the 1 MiB bound
        logger.warning("the tokenizer's longest token is unknown: prompts are bounded by 1 MiB only", exc_info=True)
        return None
    return max(1, longest) * shrink


class PromptBound:
    """Refuses a prompt that cannot fit the context, by its bytes, before it is tokenized."""

    def __init__(self, per_token: float | None) -> None:
        self.bytes_per_token = per_token

    @classmethod
    def of(cls, tokenizer: Any) -> PromptBound:
        return cls(bytes_per_token(tokenizer))

    def check(self, args: GenerateArgs, max_context: int) -> None:
        """InvalidRequestError naming the prompt (`messages` for a chat) when its text cannot fit in max_context
        tokens beside max_tokens. A chat counts its messages' contents only (the template's own text and the tools
        only add tokens), each without its leading and trailing blanks (which a template may trim)."""
        if self.bytes_per_token is None or args.prompt_token_ids is not None:
            return
        asked = args.sampling.max_tokens
        room = max(0, max_context - (1 if asked is None else asked))  # unset: the prompt leaves one token at least
        most = int(room * self.bytes_per_token)
        if args.chat:
            field_name, size = "messages", sum(len(content.strip().encode()) for _, content in args.messages)
        else:
            field_name, size = "prompt", len((args.prompt_text or "").encode())
        if size > most:
            beside = "one token to generate" if asked is None else f"max_tokens ({asked})"
            raise InvalidRequestError(field_name, f"{size} bytes of text cannot fit the {room} tokens the context "
                                                  f"of {max_context} leaves beside {beside}: at most {most} bytes")


def _most_bytes(text: str) -> int:
    return len(text) if text.isascii() else 4 * len(text)  # isascii is a flag of the string: no pass over it


def prompt_bytes(args: GenerateArgs) -> int:
    """A bound on the UTF-8 bytes of a prompt's text (a chat's messages and tools): what tokenizing it costs."""
    if args.prompt_token_ids is not None:
        return 0
    if args.chat:
        return sum(_most_bytes(content) for _, content in args.messages) + _most_bytes(args.tools)
    return _most_bytes(args.prompt_text or "")


class _Lane:
    """Worker threads taking jobs shortest first (ties in arrival order)."""

    def __init__(self, threads: int, name: str, after: Callable[[int], None]) -> None:
        self._jobs: list[tuple[int, int, Callable[[], Any], concurrent.futures.Future | None]] = []
        self._ready = threading.Condition()
        self._order = itertools.count()
        self._after = after
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, size: int, job: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._ready:
            heapq.heappush(self._jobs, (size, next(self._order), job, future))
            self._ready.notify()
        return future

    def close(self) -> None:
        with self._ready:
            for _ in self._threads:
                heapq.heappush(self._jobs, (-1, next(self._order), lambda: None, None))  # first: each thread ends
            self._ready.notify_all()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                size, _, job, future = heapq.heappop(self._jobs)
            if future is None:
                return
            if not future.set_running_or_notify_cancel():  # its request went away while it waited
                continue
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                del job
                self._after(size)


def _trim_heap() -> Callable[[], Any] | None:
    """glibc's malloc_trim (free heap pages back to the system; the tokenizer's big buffers are freed to the thread's
    arena and would stay there); None elsewhere."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class PromptEncoder:
    """Tokenizes prompts off the event loop: `await encode(args)`."""

    def __init__(self, encode: Callable[[GenerateArgs], tuple[int, ...]], threads: int = 1) -> None:
        self._encode = encode
        self._trim = _trim_heap()
        self._short = _Lane(1, "specserve-tokenize-short", self._after)
        self._long = _Lane(threads, "specserve-tokenize", self._after)

    def _after(self, size: int) -> None:
        if size >= TRIM_AFTER_BYTES and self._trim is not None:
            self._trim(0)

    async def encode(self, args: GenerateArgs, also: Callable[[], Any] | None = None) -> tuple[int, ...]:
        """The prompt's token ids (InvalidRequestError as encode raises it); `also` runs on the same thread first
        (work the engine's thread would otherwise do at submit)."""
        size = prompt_bytes(args)

        def job() -> tuple[int, ...]:
            if also is not None:
                also()
            return self._encode(args)

        lane = self._short if size <= SHORT_PROMPT_BYTES else self._long
        return await asyncio.wrap_future(lane.submit(size, job))

    def close(self) -> None:
        self._short.close()
        self._long.close()
