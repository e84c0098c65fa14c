"""A prompt group: the n completions of one request, sharing their prompt's KV (docs/ARCHITECTURE.md §4).

    submit_group([r0, r1, ... r_{n-1}])     one PromptGroup; every member's state points to it
    prefiller (r0) admitted -> one prefill-only round: the prompt but its last token, nothing sampled
    commit -> `key` = fork(prefiller)          the group's own ledger entry: the shared prompt, fixed
    each other member admitted -> fork(key)  shares every block; the partial last one is copied on write
    last member forked (or aborted) -> release(key)

Every member, the prefiller included, starts its own first round from the last prompt token, so its
rounds (and, with its own seed, its tokens) are those of an independent run of the same request.
Plain data, owned by the engine thread (shared_prompts.py holds the moves); no import of request_state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class PromptGroup:
    key: str  # the ledger entry holding the shared prompt (also a known request id in the inbox)
    prefix_len: int  # positions shared: the prompt but its last token (each member computes its logits)
    unforked: int  # members not forked from `key` yet (the prefiller counts until its prefill commits)
    prefiller_id: str | None  # the member whose prefill-only round writes the shared KV; None once done
    namespaces: tuple[str, ...] = ()  # where `key` has an entry: () until the prefiller's prefill committed


def group_key(first_request_id: str) -> str:
    """The ledger id of a group's shared prompt; the inbox refuses it as a request id while the group lives."""
    return f"{first_request_id}#shared-prompt"
