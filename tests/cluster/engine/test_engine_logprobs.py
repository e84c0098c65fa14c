"""Log-probabilities under speculation (verifier_service/logprobs.py), on a random-weight pair over every kernel path
this CPU can run:

- an emitted token's log-probabilities (its own and its top 5 alternatives) are bit for bit plain decoding's, under
  a draft model's chains and trees, n-gram chains and suffix trees, at batch 1 and 8, greedy (the same tokens as
  plain decoding) and sampled (each sampled token scored by plain greedy decoding of the same prefix: teacher
  forcing through the engine, one token a round);
- they are the float32 log-softmax of the target's logits at that position (the model run directly, outside the
  engine), to float32 rounding;
- a scored prompt's log-probabilities are bit for bit the same alone and beside other requests, equal the sum
  teacher forcing gives, and `max_tokens` 0 scores the prompt without generating;
- `processed` mode reports the distribution sampled from: a token the constraint or top-k removes has none.
No leaked block and an empty ledger after every run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve_types.api import RowLogprobs, SamplingParams
from tests.cluster.engine.engine_helpers import local_engine, request
from tests.cluster.engine.test_engine_precision import kernel_path  # noqa: F401 (the fixture)
from tests.model_runtime.random_checkpoint import make_random_checkpoint

VOCAB = 97
TOP = 5
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5], [8, 9, 10, 11, 8, 9], [12, 13, 12, 13, 12],
           [14, 15, 16, 17, 18, 14, 15], [19, 20, 19, 20, 21, 19], [22, 23, 24, 22, 23], [25, 26, 27, 28, 25, 26, 27]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("logprobs")
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  init_std=0.3)
    return make_random_checkpoint(root / "t", seed=31, **kwargs), make_random_checkpoint(root / "d", seed=32, **kwargs)


def engine_for(pair: tuple[Path, Path], draft: str, batch: int = 8):
    target, draft_dir = pair
    return local_engine(target, draft_dir if draft in ("model", "model-tree") else draft, block_size=4,
                        kv_blocks=800, max_batch=batch, dtype="float32", draft_dtype="float32",
                        model_tree_nodes=8 if draft == "model-tree" else 0, tree_nodes=8)


def outputs(engine, requests) -> dict[str, tuple[list[int], RowLogprobs | None, RowLogprobs | None, str | None]]:
    """Each request's tokens, their log-probabilities, its prompt's, and its finish reason; the ledger checked."""
    for r in requests:
        engine.submit(r)
    chunks = engine.run_to_completion()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    out = {}
    for rid, cs in chunks.items():
        tokens = [t for c in cs for t in c.token_ids]
        parts = [c.logprobs for c in cs if c.logprobs is not None]
        prompt = [c.prompt_logprobs for c in cs if c.prompt_logprobs is not None]
        assert len(prompt) <= 1, "the prompt's log-probabilities come once"
        if parts:
            assert sum(len(p) for p in parts) == len(tokens), "one row per emitted token"
        out[rid] = (tokens, RowLogprobs.concat(parts) if parts else None, prompt[0] if prompt else None,
                    cs[-1].finish_reason)
    return out


def same_bits(a: RowLogprobs, b: RowLogprobs) -> None:
    np.testing.assert_array_equal(a.token_logprobs.view(np.int32), b.token_logprobs.view(np.int32))
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    np.testing.assert_array_equal(a.top_logprobs.view(np.int32), b.top_logprobs.view(np.int32))
    np.testing.assert_array_equal(a.ranks, b.ranks)


def lp_request(rid: str, prompt: list[int], draft: str, **kwargs: object):
    base = request(rid, prompt, max_tokens=kwargs.pop("max_tokens", 20), k=kwargs.pop("k", 3),  # type: ignore[arg-type]
                   draft="model" if draft == "model-tree" else draft, **kwargs)
    return replace(base, sampling=replace(base.sampling, logprobs=TOP))


DRAFTS = ["model", "model-tree", "ngram", "suffix"]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_logprobs_equal_plain_bitwise(pair, kernel_path: str, draft: str, batch: int) -> None:  # noqa: F811
    prompts = PROMPTS[:batch]
    plain = outputs(engine_for(pair, "none", batch), [lp_request(f"r{i}", p, "none", k=0) for i, p in
                                                      enumerate(prompts)])
    spec = outputs(engine_for(pair, draft, batch), [lp_request(f"r{i}", p, draft, k=None if draft == "suffix" else 4)
                                                    for i, p in enumerate(prompts)])
    for rid, (tokens, logprobs, _, _) in plain.items():
        assert spec[rid][0] == tokens
        assert logprobs is not None and spec[rid][1] is not None
        same_bits(spec[rid][1], logprobs)
        assert (logprobs.top_ids[:, 0] == np.array(tokens)).all(), "greedy takes the likeliest token"
        assert (logprobs.ranks == 1).all()


def scored(pair, prompt: list[int], batch: int = 1, others: int = 0) -> RowLogprobs:
    """The prompt's log-probabilities from a request that only scores it (max_tokens 0), alone or beside `others`
    requests that generate; checks it ends with `length` and nothing generated."""
    target = lp_request("scored", prompt, "none", k=0, max_tokens=0, ignore_eos=True, prompt_logprobs=TOP)
    company = [lp_request(f"o{i}", p, "none", k=0, max_tokens=6) for i, p in enumerate(PROMPTS[:others])]
    out = outputs(engine_for(pair, "none", batch), [*company, target])
    tokens, logprobs, prompt_lp, finish = out["scored"]
    assert tokens == [] and finish == "length" and prompt_lp is not None and len(prompt_lp) == len(prompt) - 1
    assert logprobs is None or len(logprobs) == 0
    return prompt_lp


def hf_logprobs(target: Path, sequence: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax of the target's logits at every position of `sequence` (the same
    checkpoint), [len, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("draft", ["model", "ngram", "suffix"])
def test_sampled_logprobs_equal_a_scored_prompt(pair, kernel_path: str, draft: str) -> None:  # noqa: F811
    """Sampled (exact) speculation's tokens at batch 4: each one's log-probabilities are bit for bit those of its
    position when prompt + output is scored as one prompt (one prefill forward: the rows do not depend on how many
    rows the forward computes), and transformers' float32 log-softmax to 2e-5."""
    prompts = PROMPTS[:4]
    spec = outputs(engine_for(pair, draft, 4), [
        lp_request(f"r{i}", p, draft, k=None if draft == "suffix" else 4, temperature=1.0, seed=100 + i,
                   contract="exact", max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        tokens, logprobs, _, _ = spec[f"r{i}"]
        assert logprobs is not None and len(tokens) == 12
        whole = scored(pair, prompt + tokens)
        same_bits(logprobs, whole.rows(len(prompt) - 1, len(whole)))
        reference = hf_logprobs(pair[0], prompt + tokens)[len(prompt) - 1:-1]
        expected = reference[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.from_numpy(logprobs.token_logprobs), expected, atol=2e-5, rtol=0)


def test_scored_prompt_alone_and_in_a_batch(pair, kernel_path: str) -> None:  # noqa: F811
    """A prompt's log-probabilities are the same bits alone and beside generating requests, and match
    transformers'; their sum is the prompt's log-likelihood teacher forcing gives."""
    prompt = PROMPTS[0] + PROMPTS[1]
    alone = scored(pair, prompt)
    beside = scored(pair, prompt, batch=4, others=3)
    same_bits(alone, beside)
    reference = hf_logprobs(pair[0], prompt)[:-1]
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.from_numpy(alone.token_logprobs), expected, atol=2e-5, rtol=0)
    assert abs(float(alone.token_logprobs.astype(np.float64).sum()) - float(expected.double().sum())) < 1e-3


def test_echo_with_generation_scores_prompt_once(pair) -> None:
    """prompt_logprobs beside generation: the first chunk carries the prompt's rows, the output is plain
    decoding's."""
    r = lp_request("g", PROMPTS[2], "model", k=4, max_tokens=10, ignore_eos=True)
    r = replace(r, sampling=replace(r.sampling, prompt_logprobs=0))
    plain = outputs(engine_for(pair, "none", 1), [lp_request("g", PROMPTS[2], "none", k=0, max_tokens=10,
                                                             ignore_eos=True)])
    (tokens, logprobs, prompt_lp, _), = outputs(engine_for(pair, "model", 1), [r]).values()
    assert tokens == plain["g"][0]
    assert prompt_lp is not None and len(prompt_lp) == len(PROMPTS[2]) - 1 and prompt_lp.top_ids.shape == (5, 0)


def test_processed_mode_reports_the_sampled_distribution(pair) -> None:
    """`processed`: top-k 3 leaves three tokens a row (the rest -inf), each emitted token among them, the three
    summing to probability 1."""
    r = lp_request("p", PROMPTS[3], "model", k=4, max_tokens=10, temperature=0.8, top_k=3, seed=7, contract="exact",
                   ignore_eos=True)
    r = replace(r, sampling=replace(r.sampling, logprobs_mode="processed"))
    (tokens, logprobs, _, _), = outputs(engine_for(pair, "model", 1), [r]).values()
    assert logprobs is not None
    assert np.isfinite(logprobs.top_logprobs[:, :3]).all() and np.isneginf(logprobs.top_logprobs[:, 3:]).all()
    np.testing.assert_allclose(np.exp(logprobs.top_logprobs[:, :3].astype(np.float64)).sum(-1), 1.0, atol=1e-5)
    assert all(t in set(ids[:3]) for t, ids in zip(tokens, logprobs.top_ids.tolist(), strict=True))


def test_logprobs_checked() -> None:
    for bad in ({"logprobs": 21}, {"prompt_logprobs": -1}, {"logprobs_mode": "logits"}, {"max_tokens": 0}):
        with pytest.raises(Exception, match=next(iter(bad)) if "max" not in next(iter(bad)) else "max_tokens"):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
