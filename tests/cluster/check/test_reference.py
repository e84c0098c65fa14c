"""The check's reference under constrained decoding (cluster/check/reference.py): the logit bias added to the raw
logits, the constraint's mask along the prefix, then the request's transform; and the masks compiled as the engine
compiles them (llguidance over the target's tokenizer)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.check.reference import ConstraintMasks, TargetReference
from specserve_types.api import Constraint, InvalidRequestError, SamplingParams

LOGITS = [2.0, 1.0, 0.0, 3.0, -1.0]  # token 3 is the argmax


class FixedModel:
    """A CausalLM stand-in whose last row is LOGITS whatever the tokens."""

    def allocate_kv(self, blocks: int, block_size: int) -> None:
        return None

    def forward_seqs(self, seqs: list[Any], kv: Any) -> list[torch.Tensor]:
        return [torch.tensor([LOGITS])]


class FixedMasks:
    """ConstraintMasks' interface: tokens 0..2 allowed after any prefix; the prefixes asked for are kept."""

    def __init__(self) -> None:
        self.prefixes: list[tuple[int, ...]] = []

    def words(self, prefix: Sequence[int]) -> torch.Tensor:
        self.prefixes.append(tuple(prefix))
        return torch.tensor([[0b00111]], dtype=torch.int32)


def test_bias_then_mask_then_transform() -> None:
    sampling = SamplingParams(temperature=1.0, logit_bias=((1, 1.0), (4, 100.0)))
    masks = FixedMasks()
    p = TargetReference(FixedModel(), sampling, masks=masks).probs([9, 9], [5, 6])  # type: ignore[arg-type]
    assert masks.prefixes == [(5, 6)]  # the mask after the prefix (the output so far), not the prompt
    allowed = torch.tensor([2.0, 2.0, 0.0]).softmax(-1).double()  # token 1 biased to 2.0; 3 and 4 (even +100) masked
    assert torch.allclose(p[:3], allowed) and p[3] == 0 and p[4] == 0
    greedy = TargetReference(FixedModel(), SamplingParams(), masks=FixedMasks()).probs([1], [])  # type: ignore[arg-type]
    assert greedy.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # the best allowed token, not the argmax 3


def test_without_constraint_or_bias_the_reference_is_unchanged() -> None:
    p = TargetReference(FixedModel(), SamplingParams(temperature=1.0)).probs([1], [2])  # type: ignore[arg-type]
    assert torch.allclose(p, torch.tensor(LOGITS).softmax(-1).double())
    biased = TargetReference(FixedModel(), SamplingParams(temperature=1.0, logit_bias=((0, -100.0),)))
    assert biased.probs([1], [])[0] < 1e-40  # type: ignore[arg-type]


def test_masks_follow_the_prefix_on_the_real_tokenizer(smollm2_dir: Path) -> None:
    from cluster.engine.factory import eos_token_ids, load_tokenizer
    from model_runtime.config import ModelConfig

    tokenizer, config = load_tokenizer(smollm2_dir), ModelConfig.from_dir(smollm2_dir)
    masks = ConstraintMasks(Constraint("regex", "(red|green|blue)(, (red|green|blue))*"), tokenizer, config.vocab_size,
                            eos_token_ids(smollm2_dir, config, tokenizer))

    def allowed(prefix: list[int]) -> set[str]:
        words = masks.words(prefix)
        assert words.shape == (1, (config.vocab_size + 31) // 32) and words.dtype == torch.int32
        bits = (words[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return {tokenizer.decode([t]) for t in bits.flatten().nonzero().flatten().tolist()}

    first = allowed([])
    assert {"red", "green", "blue"} <= first and " red" not in first and "," not in first
    red = tokenizer("red")["input_ids"]
    assert allowed(red) == {",", tokenizer.eos_token}  # after a whole colour: a comma, or the end
    after_comma = allowed(tokenizer("red,")["input_ids"])  # the space, alone or with a colour's start
    assert {" ", " red", " g", " blue"} <= after_comma and all(text.startswith(" ") for text in after_comma)
    with pytest.raises(InvalidRequestError) as info:  # refused before any sample is drawn, naming the flag
        ConstraintMasks(Constraint("regex", "(unclosed", "--regex"), tokenizer, config.vocab_size,
                        eos_token_ids(smollm2_dir, config, tokenizer))
    assert info.value.field == "--regex" and "does not compile" in info.value.message
