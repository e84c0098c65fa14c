"""DraftWorker's chains: a greedy chain with `stop_below` ends after a draft the draft model is unsure of (1..k
drafts, the unsure one included); without it, or for a sampled request, it drafts k. A greedy tree with it feeds
no level whose best path is unsure (its siblings there kept). Through the engine: auto's greedy chains and trees
stop early, the output is still plain greedy decoding, and the ledger ends empty."""

from __future__ import annotations

from cluster.engine.round_plan import MODEL_TREE_WIDTH
from drafter_service.worker import DraftWorker
from specserve_types.api import SamplingParams
from specserve_types.round_messages import ProposeBatch, ProposeItem, ProposeResult
from tests.cluster.engine.engine_helpers import (
    FAKE_VOCAB,
    FakeRunner,
    fake_engine,
    fake_greedy,
    fake_next_token,
    request,
    run,
)
from verifier_service.tree_contracts import TokenTree

BLOCK = 4
PROMPT = [5, 17, 42, 8, 3, 11]


def unsure_every_fifth(sequence: list[int]) -> int | list[int]:
    """The target's token, but where len % 5 == 0 two tokens nearly tied (the top one at ~0.73)."""
    token = fake_next_token(sequence)
    return [token, (token + 1) % FAKE_VOCAB] if len(sequence) % 5 == 0 else token


GREEDY = SamplingParams()


def propose(k: int, stop_below: float, sampling: SamplingParams = GREEDY) -> list[int]:
    worker = DraftWorker(FakeRunner(unsure_every_fifth, BLOCK))
    blocks = list(range((len(PROMPT) + k) // BLOCK + 1))
    item = ProposeItem(request_id="r", input_ids=PROMPT, past_len=0, block_table=blocks,
                       slot_mapping=list(range(len(PROMPT) + k - 1)), k=k, sampling=sampling, seed=1,
                       position=len(PROMPT), want_probs=not sampling.is_greedy, stop_below=stop_below)
    (out,) = worker.propose(ProposeBatch([item])).outputs
    return out.draft_ids


def test_a_greedy_chain_stops_after_an_unsure_draft() -> None:
    full = propose(7, 0.0)
    assert len(full) == 7
    # PROMPT has 6 tokens: drafts 1..4 follow sequences of 6..9 tokens (sure), draft 5 one of 10 (unsure): it is the last
    assert propose(7, 0.9) == full[:5]
    assert propose(7, 0.5) == full  # 0.73 is above it: no stop
    assert propose(3, 0.9) == full[:3]


def propose_tree(k: int, stop_below: float, nodes: int = 12) -> tuple[list[int], list[int]]:
    worker = DraftWorker(FakeRunner(unsure_every_fifth, BLOCK))
    slots = len(PROMPT) + MODEL_TREE_WIDTH * (k - 1)
    item = ProposeItem(request_id="t", input_ids=PROMPT, past_len=0, block_table=list(range(slots // BLOCK + 1)),
                       slot_mapping=list(range(slots)), k=k, sampling=GREEDY, seed=1, position=len(PROMPT),
                       want_probs=False, stop_below=stop_below, tree_nodes=nodes, tree_width=MODEL_TREE_WIDTH)
    (out,) = worker.propose(ProposeBatch([item])).outputs
    assert out.draft_parents is not None
    return out.draft_ids, out.draft_parents


def depths(tokens: list[int], parents: list[int]) -> list[int]:
    return TokenTree(tuple(tokens), tuple(parents)).depths()


def best_path(tokens: list[int], parents: list[int], levels: int) -> list[int]:
    """Each level's first node (the tree's order: by level, siblings by the draft's rank)."""
    d = depths(tokens, parents)
    return [tokens[d.index(level)] for level in range(1, levels + 1)]


def test_a_greedy_tree_feeds_no_level_whose_best_path_is_unsure() -> None:
    full_tokens, full_parents = propose_tree(7, 0.0)
    assert max(depths(full_tokens, full_parents)) == 7
    # levels 1..4 are sure; level 5's candidates (after 10 tokens) tie at ~0.73 / 0.27: under 0.9 the tree keeps
    # them (its siblings) and feeds them no further
    tokens, parents = propose_tree(7, 0.9)
    assert max(depths(tokens, parents)) == 5
    assert sum(1 for d in depths(tokens, parents) if d == 5) == 2
    assert best_path(tokens, parents, 5) == best_path(full_tokens, full_parents, 5)


def test_sampled_chains_draft_k_whatever_stop_below() -> None:
    assert len(propose(5, 0.9, SamplingParams(temperature=0.8))) == 5


class RecordingDrafter:
    def __init__(self, inner: DraftWorker) -> None:
        self.inner = inner
        self.asked_and_got: list[tuple[int, int, float]] = []

    def propose(self, batch: ProposeBatch) -> ProposeResult:
        result = self.inner.propose(batch)
        lengths = {o.request_id: len(o.draft_ids) for o in result.outputs}
        self.asked_and_got += [(i.k, lengths[i.request_id], i.stop_below) for i in batch.items]
        return result


def test_auto_greedy_chains_stop_early_and_stay_exact() -> None:
    engine = fake_engine(draft_rule=unsure_every_fifth, draft_stop_below=0.9, k_max=4)
    recorder = RecordingDrafter(engine.drafter)
    engine.drafter = recorder
    prompts = [PROMPT, [9, 1, 77, 30]]
    outputs = run(engine, [request(f"r{i}", p, max_tokens=40, k=None) for i, p in enumerate(prompts)])
    assert outputs == {f"r{i}": fake_greedy(p, 40) for i, p in enumerate(prompts)}
    assert any(got < asked for asked, got, _ in recorder.asked_and_got), recorder.asked_and_got
    assert all(1 <= got <= asked for asked, got, _ in recorder.asked_and_got)
    assert all(stop == 0.9 for asked, _, stop in recorder.asked_and_got if asked > 1)
    chains = engine.stats()["draft_chains"]
    assert chains["may_stop"] == sum(1 for asked, _, stop in recorder.asked_and_got if stop > 0)
    assert chains["stopped"] == sum(1 for asked, got, stop in recorder.asked_and_got if stop > 0 and got < asked) > 0


def test_fixed_k_and_sampled_requests_draft_k() -> None:
    engine = fake_engine(draft_rule=unsure_every_fifth, draft_stop_below=0.9)
    recorder = RecordingDrafter(engine.drafter)
    engine.drafter = recorder
    run(engine, [request("fixed", PROMPT, max_tokens=20, k=3),
                 request("sampled", PROMPT, max_tokens=20, k=None, contract="exact", temperature=0.8, seed=3)])
    assert recorder.asked_and_got and all(got == asked and stop == 0.0 for asked, got, stop in recorder.asked_and_got)
    assert engine.stats()["draft_chains"] == engine.stats()["draft_trees"] == {"may_stop": 0, "stopped": 0}


def test_auto_greedy_trees_stop_early_and_stay_exact() -> None:
    engine = fake_engine(draft_rule=unsure_every_fifth, draft_stop_below=0.9, k_max=6, model_tree_nodes=10)
    recorder = RecordingDrafter(engine.drafter)
    engine.drafter = recorder
    prompts = [PROMPT, [9, 1, 77, 30]]
    outputs = run(engine, [request(f"r{i}", p, max_tokens=40, k=None) for i, p in enumerate(prompts)])
    assert outputs == {f"r{i}": fake_greedy(p, 40) for i, p in enumerate(prompts)}
    assert engine.acceptance.tree_rounds > 0
    assert all(stop == 0.9 for asked, _, stop in recorder.asked_and_got if asked > 1)
    assert engine.stats()["draft_chains"]["may_stop"] == 0  # the chains' count: no tree in it
    trees = engine.stats()["draft_trees"]
    assert trees["may_stop"] == sum(1 for asked, _, stop in recorder.asked_and_got if stop > 0) > 0
    assert 0 < trees["stopped"] < trees["may_stop"]
