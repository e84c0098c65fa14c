"""A request's stop strings as one automaton (Aho-Corasick): the text tracker (request_state.TextTracker) feeds it each
new character once, and reads off whether a stop string ended and how much of the text's end could still start one.

So a token costs the same whatever the stop strings (a step per new character, amortized), where searching each stop
string in the text and trying each of its prefixes against the text's end cost stop strings x their length a token
(16 stop strings of 256 characters: 1.6 ms a token on an EPYC; the automaton: microseconds). Building it costs their
characters once (docs/api.md, "Limits", bounds them); it is immutable once built, and shared (`stop_matcher` keeps the
last few), so the n completions of a request, and requests with the same stop strings, build it once.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

ROOT = 0


class StopMatcher:
    """The trie of the stop strings with failure links. A state is a node: the longest suffix of the text fed so far
    that is a prefix of some stop string; `depth[state]` is its length, `ends[state]` whether a stop string ends
    there (it, or a suffix of it)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth: list[int] = [0]
        self.ends: list[bool] = [False]
        for stop in stops:
            state = ROOT
            for char in stop:
                following = self.goto[state].get(char)
                if following is None:
                    following = len(self.goto)
                    self.goto[state][char] = following
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ends.append(False)
                state = following
            self.ends[state] = True
        self.fail = [ROOT] * len(self.goto)
        queue = deque(self.goto[ROOT].values())
        while queue:  # breadth first: a node's failure link is shallower, so already final
            state = queue.popleft()
            for char, following in self.goto[state].items():
                self.fail[following] = self.step(self.fail[state], char)
                self.ends[following] = self.ends[following] or self.ends[self.fail[following]]
                queue.append(following)

    def step(self, state: int, char: str) -> int:
        """The state after one more character."""
        goto, fail = self.goto, self.fail
        while state != ROOT and char not in goto[state]:
            state = fail[state]
        return goto[state].get(char, ROOT)


@lru_cache(maxsize=16)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton of these stop strings (the last few built are kept: n completions share one)."""
    return StopMatcher(stops)
