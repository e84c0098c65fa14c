"""The engine's three step modes (step_modes.py), model-free (engine_helpers.fake_engine): each is chosen at
construction from the config, runs the shared phases to the plain greedy output, holds a commit only where
it may (serial), and ends with the ledger checked (empty) and no leaked block."""

from __future__ import annotations

import collections

import pytest

from cluster.engine.step_modes import PING_PONG, PREDRAFTING, SERIAL
from specserve_types.api import TokenChunk
from tests.cluster.engine.engine_helpers import fake_engine, fake_greedy, fake_next_token, request

MODES = {"serial": (False, False, SERIAL), "two groups": (True, False, PING_PONG), "pre-drafting": (True, True, PREDRAFTING)}
PROMPTS = {f"r{i}": [3 + i, 5, 7, 11, 13][: 3 + i % 3] * 2 for i in range(6)}


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_gives_plain_greedy_output_and_gives_every_block_back(mode: str) -> None:
    overlap, predraft, kind = MODES[mode]
    engine = fake_engine(max_batch=4, overlap=overlap, predraft=predraft, draft_rule=fake_next_token)
    assert engine.mode == kind
    for rid, prompt in PROMPTS.items():
        engine.submit(request(rid, prompt, max_tokens=10 + len(prompt), k=3))
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    held_seen = False
    while engine.has_unfinished():
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
        held_seen = held_seen or bool(engine.kv.held)
    for rid, prompt in PROMPTS.items():
        assert [t for c in out[rid] for t in c.token_ids] == fake_greedy(prompt, 10 + len(prompt)), rid
        assert out[rid][-1].finish_reason == "length"
    assert held_seen == (kind != PING_PONG)  # ping-pong rounds never hold their commit for the next reserve
    engine.close()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    stats = engine.stats()
    assert sum(c.accepted for chunks in out.values() for c in chunks) > 0  # the rounds did speculate
    assert ("predraft" in stats["overlap"]) == (kind == PREDRAFTING)


def test_predrafting_without_overlap_is_serial() -> None:
    engine = fake_engine(overlap=False, predraft=True)
    assert engine.mode == SERIAL and engine.pipeline is None and engine.predrafter is None
