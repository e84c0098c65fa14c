"""Draft models for llama-cpp-python's speculative loop (imports llama_cpp: load only when it is installed).

llama-cpp-python ships prompt lookup only (`LlamaPromptLookupDecoding`); its `Llama(draft_model=...)` calls
`draft_model(input_ids) -> draft ids` once per round with every token so far (prompt, output, and the
round's new token), evaluates the new token and the drafts in one batch, and keeps the drafts up to the
first one that differs from its own greedy choice.

`GreedyDraftModel` is a draft *model*: a second `Llama` (the draft GGUF) proposing k tokens greedily. Its KV
cache keeps the longest common prefix with `input_ids` (its own generate loop's prefix match), so a round
evaluates only the tokens it has not seen: the accepted drafts' tail and the new token, then k - 1 more.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaDraftModel


class GreedyDraftModel(LlamaDraftModel):
    def __init__(self, draft: Llama, k: int) -> None:
        assert k >= 1, k
        self.draft = draft
        self.k = k

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        proposed: list[int] = []
        tokens = self.draft.generate(input_ids.tolist(), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                     repeat_penalty=1.0, reset=True)
        try:
            for token in tokens:
                proposed.append(int(token))
                if len(proposed) == self.k:
                    break
        finally:
            tokens.close()
        return np.array(proposed, dtype=np.intc)

    def reset(self) -> None:
        """Empty the draft's KV cache (a new request, no prefix reuse across runs)."""
        self.draft.reset()


class CountingDraft(LlamaDraftModel):
    """Any draft, counting its calls (speculative rounds) and proposed tokens since the last reset."""

    def __init__(self, inner: LlamaDraftModel) -> None:
        self.inner = inner
        self.calls = 0
        self.proposed = 0

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        drafts = self.inner(input_ids, **kwargs)
        self.calls += 1
        self.proposed += len(drafts)
        return drafts

    def reset(self) -> None:
        self.calls = self.proposed = 0
        if isinstance(self.inner, GreedyDraftModel):
            self.inner.reset()
