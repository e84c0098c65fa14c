"""The text tracker: incremental detokenization that reads exactly as decoding the whole output each token did; and
what an unset max_tokens comes to (resolve_max_tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cluster.engine.request_state import TextTracker, resolve_max_tokens
from specserve_types.api import MAX_TOKENS_LIMIT, InvalidRequestError, SamplingParams

TEXTS = ["Hello, world! Ça va? 日本語のテキスト 🤖🎉 — naïve café.\n\tdef f(x):\n        return x ** 2\n",
         "Stop here. STOP. The end!!! ... ?? \u00a0 ok", "ü" * 30 + "🙂" * 20 + " spaces   and\n\nnewlines"]


@dataclass
class WholeDecode:
    """The tracker as it was: the whole output decoded every token, each stop string searched and each of its prefixes
    tried against the text's end (the reference; O(n) a token)."""

    tokenizer: Any
    prompt_len: int
    stop: tuple[str, ...]
    emitted_chars: int = 0
    text: str = ""

    def update(self, token_ids: list[int]) -> tuple[str, bool]:
        self.text = self.tokenizer.decode(token_ids[self.prompt_len:], skip_special_tokens=True)
        for s in self.stop:
            idx = self.text.find(s, max(0, self.emitted_chars - len(s) + 1))
            if idx != -1:
                self.text = self.text[:idx]
                delta = self.text[self.emitted_chars:]
                self.emitted_chars = len(self.text)
                return delta, True
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        held = max((n for s in self.stop for n in range(1, min(len(s) - 1, safe) + 1)  # the longest end that may
                    if self.text[:safe].endswith(s[:n])), default=0)  # start a stop string
        safe = max(safe - held, self.emitted_chars)
        delta = self.text[self.emitted_chars:safe]
        self.emitted_chars = safe
        return delta, False

    def flush(self) -> str:
        delta = self.text[self.emitted_chars:].rstrip("\ufffd")
        self.emitted_chars = len(self.text)
        return delta


class CountingTokenizer:
    """Counts the ids it decodes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.decoded = inner, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


class CleanUpTokenizer:
    """A decoder that rewrites text across token boundaries (" ." -> ".", as transformers' clean-up of spaces)."""

    vocab = ["Hello", " ", ".", " world", "!", " .", "a"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids).replace(" .", ".")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style decoder: each word's "▁" is a space, except the decode's first."""
    words = ["<unk>", "▁Hello", "▁world", "!", "▁The", "▁end", ".", "▁stop", "ing", "▁é", "▁🙂"]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    inner.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=inner)


def run(tracker: Any, prompt: list[int], output: list[int]) -> list[tuple[str, bool, str]]:
    """Feed the output token by token as RequestState.append_tokens does: (delta, stop hit, text) each, then flush."""
    seen, out = list(prompt), []
    for token in output:
        seen.append(token)
        delta, hit = tracker.update(seen)
        out.append((delta, hit, tracker.text))
        if hit:
            return out
    out.append((tracker.flush(), False, tracker.text))
    return out


def sequences(tokenizer: Any, vocab: int, seed: int) -> list[list[int]]:
    """The texts' own tokens, and random ids (byte pieces of characters, special tokens, anything)."""
    rng = random.Random(seed)
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    return encoded + [[rng.randrange(vocab) for _ in range(rng.randrange(1, 120))] for _ in range(30)]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_every_delta_and_stop_as_the_whole_decode(smollm2_tokenizer: Any) -> None:
    """SmolLM2's byte-level tokenizer: the same deltas, stop hits and text at every token as the whole decode,
    with and without stop strings (across token boundaries, and halves of multi-byte characters)."""
    tok = smollm2_tokenizer
    rng = random.Random(7)
    for i, ids in enumerate(sequences(tok, len(tok), seed=1)):
        text = tok.decode(ids, skip_special_tokens=True)
        stops: list[tuple[str, ...]] = [(), ("\n\n",), ("STOP", "end!")]
        if len(text) > 8:
            at = rng.randrange(len(text) - 4)
            stops.append((text[at:at + rng.randrange(1, 5)],))
        for stop in stops:
            prompt = [1, 2, 3][: i % 4]
            ours = run(TextTracker(tok, len(prompt), stop), prompt, ids)
            assert ours == run(WholeDecode(tok, len(prompt), stop), prompt, ids), (ids, stop)


def test_text_is_the_whole_decode_for_other_decoders() -> None:
    """A SentencePiece-style decoder (the first word's space dropped) and one that rewrites across tokens."""
    meta = metaspace_tokenizer()
    rng = random.Random(3)
    for tok, vocab in ((meta, len(meta)), (CleanUpTokenizer(), len(CleanUpTokenizer.vocab))):
        for _ in range(40):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
            for stop in [(), (".",), ("d!",)]:
                ours = run(TextTracker(tok, 0, stop), [], ids)
                assert ours == run(WholeDecode(tok, 0, stop), [], ids), (ids, stop)


def test_a_token_decodes_a_few_tokens_not_the_output(smollm2_tokenizer: Any) -> None:
    """2000 output tokens: each update decodes at most a few tokens beyond the new one (the whole decode: n a token,
    2 million ids in all)."""
    tok = CountingTokenizer(smollm2_tokenizer)
    ids = (smollm2_tokenizer.encode("".join(TEXTS), add_special_tokens=False) * 60)[:2000]
    tracker = TextTracker(tok, 0, ("never appears",))
    seen: list[int] = []
    for token in ids:
        seen.append(token)
        tracker.update(seen)
    assert tracker.text == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.decoded <= 20 * len(ids), tok.decoded


def test_many_overlapping_stop_strings_as_the_reference(smollm2_tokenizer: Any) -> None:
    """Several stop strings that share prefixes and are suffixes of each other, cut from the output itself: the same
    deltas, hits and text as searching each one and trying each of its prefixes."""
    tok = smollm2_tokenizer
    rng = random.Random(11)
    for ids in sequences(tok, len(tok), seed=2):
        text = tok.decode(ids, skip_special_tokens=True)
        if len(text) < 12:
            continue
        for _ in range(4):
            pieces = []
            for _ in range(rng.randrange(2, 9)):
                at = rng.randrange(len(text) - 3)
                pieces.append(text[at:at + rng.randrange(1, 12)])
            pieces += [p[1:] + "#" for p in pieces if len(p) > 1]  # shared middles, no match
            stop = tuple(rng.sample(pieces, len(pieces)))
            assert run(TextTracker(tok, 0, stop), [], ids) == run(WholeDecode(tok, 0, stop), [], ids), (ids, stop)


def test_a_token_costs_the_same_whatever_the_stop_strings(smollm2_tokenizer: Any) -> None:
    """64 stop strings of 256 characters that the output keeps almost starting ("abab..." against "aaaa..."): the
    automaton reads each character of the output once (trying each prefix of each read 64 x 255 of them a token)."""
    from cluster.engine import stop_strings

    ids = smollm2_tokenizer.encode("a" * 4000, add_special_tokens=False)
    stop = tuple("ab" * 127 + f"{i:02d}" for i in range(64))
    matcher = stop_strings.stop_matcher(stop)
    steps = 0
    step = matcher.step

    def counted(state: int, char: str) -> int:
        nonlocal steps
        steps += 1
        return step(state, char)

    matcher.step = counted  # type: ignore[method-assign]
    try:
        out = run(TextTracker(smollm2_tokenizer, 0, stop), [], ids)
    finally:
        del matcher.step
    assert "".join(delta for delta, _, _ in out) == "a" * 4000 and not any(hit for _, hit, _ in out)
    assert steps <= 4000 + len(ids), steps
    assert all(len(delta) > 0 for delta, _, _ in out[1:-1])  # only the last "a" held back, each token


def test_an_unset_max_tokens_is_what_the_context_leaves() -> None:
    """resolve_max_tokens: a value set stays; unset, the context's room beside the prompt, within `most`."""
    asked = SamplingParams(max_tokens=7)
    assert resolve_max_tokens(asked, 100, 128) is asked
    assert resolve_max_tokens(SamplingParams(), 100, 128).max_tokens == 28
    assert resolve_max_tokens(SamplingParams(), 1, 1 << 20).max_tokens == MAX_TOKENS_LIMIT
    assert resolve_max_tokens(SamplingParams(), 1, 2048, most=512).max_tokens == 512
    assert resolve_max_tokens(SamplingParams(), 127, 128).max_tokens == 1
    with pytest.raises(InvalidRequestError, match=r"prompt \(128 tokens\) leaves no room") as refused:
        resolve_max_tokens(SamplingParams(), 128, 128)
    assert refused.value.field == "prompt"
