"""The suffix trie in C++ (native/suffix_trie.cpp): the Python SuffixTrie's counts, matches and proposals at a hash
lookup a node visit instead of ~1 us (a prompt of L tokens visits 24 L nodes: ~7 ms for 300 tokens in Python on
the Xeon-AMX, which SmolLM2's ~11 ms rounds felt).

    make_trie(max_depth)  the C++ trie where it builds (once per machine, like the kernels), else the Python one
    status()              which, in words

`python -m drafter_service.suffix_native` builds it and says which (`make setup` runs it).

Owner of `_BUILT`: this module; the build is loaded once per process, then only read. A trie is owned by the
engine thread, as the Python one (drafter_service/suffix_drafts.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from drafter_service.suffix_tree import MAX_DEPTH, MAX_MATCH, Proposal, SuffixTrie
from model_runtime.kernel_build import build_extension
from verifier_service.tree_contracts import TokenTree

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "native" / "suffix_trie.cpp"
_BUILT: list[tuple[ModuleType | None, str]] = []


def _module() -> ModuleType | None:
    if not _BUILT:
        module, why = build_extension("suffix trie", "specserve_suffix_trie", [SOURCE], ["-O2"], "suffix-trie",
                                      "portable")
        _BUILT.append((module, "C++ (drafter_service/native/suffix_trie.cpp)" if module is not None else
                       f"Python ({why})"))
        if module is None:
            log.warning("suffix trie: %s", why)
    return _BUILT[0][0]


def status() -> str:
    _module()
    return f"suffix trie: {_BUILT[0][1]}"


class NativeTrie:
    """SuffixTrie's interface (extend, remove, match via propose, `in`) on the C++ trie."""

    def __init__(self, module: ModuleType, max_depth: int = MAX_DEPTH) -> None:
        self.max_depth = max_depth
        self._trie = module.Trie(max_depth)

    def __contains__(self, seq_id: int) -> bool:
        return bool(self._trie.contains(seq_id))

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        self._trie.extend(seq_id, list(tokens))

    def remove(self, seq_id: int) -> None:
        self._trie.remove(seq_id)

    def propose(self, context: Sequence[int], budget: int, min_score: float = 0.0,
                max_match: int = MAX_MATCH, levels: int | None = None) -> Proposal | None:
        found = self._trie.propose(list(context), budget, min_score, max_match, levels)
        if found is None:
            return None
        tokens, parents, scores, match_len = found
        return Proposal(TokenTree(tuple(tokens), tuple(parents)), tuple(scores), match_len)

    def paths(self) -> dict[tuple[int, ...], int]:
        """Every path of the trie and its count."""
        return {tuple(path): count for path, count in self._trie.paths()}

    def live_nodes(self) -> int:
        return int(self._trie.live_nodes())


def make_trie(max_depth: int = MAX_DEPTH) -> NativeTrie | SuffixTrie:
    module = _module()
    return NativeTrie(module, max_depth) if module is not None else SuffixTrie(max_depth)


if __name__ == "__main__":
    print(status())


__all__ = ["NativeTrie", "make_trie", "status"]
