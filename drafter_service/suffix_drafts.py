"""The engine's suffix drafter: token trees for `draft="suffix"` requests, made on the engine thread like n-gram
drafts (no worker call, no draft KV).

    propose(request_id, tokens, budget) -> Proposal | None   its trie catches up with the request's tokens first
    finish(request_id, output)          a finished request's output joins the global trie of earlier outputs
    retain(request_ids)                 tries of requests that left otherwise (aborted, failed) are dropped

Owner: the engine thread (one per engine; the global trie is per target model, as the engine is).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from drafter_service.suffix_native import make_trie
from drafter_service.suffix_tree import Proposal, SuffixCache

MIN_SCORE = 0.02  # candidates the trie gives less than a 2% chance of following are not worth a verify row


class SuffixDrafter:
    def __init__(self, max_outputs: int = 256, min_score: float = MIN_SCORE) -> None:
        self.cache = SuffixCache(max_outputs, make_trie=make_trie)  # the C++ trie where it builds
        self.min_score = min_score
        self._added: dict[str, int] = {}  # request id -> tokens its trie holds

    def propose(self, request_id: str, tokens: Sequence[int], budget: int, levels: int,
                own_only: bool = False) -> Proposal | None:
        """Up to `budget` nodes, at most `levels` deep, after `tokens` (the request's prompt and output so far);
        `own_only`: from the request's own trie, not the global one (a seeded request's drafts)."""
        added = self._added.get(request_id, 0)
        if len(tokens) < added:  # cannot shrink: tokens are only appended; a reused id starts over
            self.cache.forget(request_id)
            added = 0
        if len(tokens) > added:
            self.cache.extend(request_id, tokens[added:])
            self._added[request_id] = len(tokens)
        return self.cache.propose(request_id, tokens, budget, self.min_score, levels, use_global=not own_only)

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        """The request ended: its trie goes; its `output` (empty: none) joins the global trie."""
        self._added.pop(request_id, None)
        self.cache.finish(request_id, output)

    def retain(self, request_ids: Iterable[str]) -> None:
        if not self._added:
            return
        keep = set(request_ids)
        for request_id in [r for r in self._added if r not in keep]:
            self._added.pop(request_id)
            self.cache.forget(request_id)

    def live(self) -> int:
        return len(self._added)


__all__ = ["MIN_SCORE", "SuffixDrafter"]
