"""The reference distribution of `specserve check exact`: the target model alone, one plain forward of
prompt + prefix, the request's sampling transform on its last row. Under constrained decoding the row first gets
the request's logit_bias (added to the raw logits) and the constraint's mask along the prefix (-inf for every token
it forbids after prompt + prefix), with the verifier's own functions (verifier_service/sampling.py; the check sets
no penalties, which would come between the two), then the transform: the target's constrained distribution."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specserve_types.api import Constraint, SamplingParams, SpecServeError

if TYPE_CHECKING:
    from cluster.engine.engine import SpecEngine
    from model_runtime.model import CausalLM


class ConstraintMasks:
    """The tokens a constraint allows after an output prefix, compiled as the engine compiles it
    (verifier_service/constraint.py, llguidance): a fresh matcher per prefix, advanced by the prefix."""

    def __init__(self, constraint: Constraint, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        from verifier_service.constraint import ConstraintCompiler

        self.constraint = constraint
        self._compiler = ConstraintCompiler(tokenizer, vocab_size, eos_token_ids)
        self._compiler.compile(constraint)  # a bad constraint fails here, before any sample is drawn

    def words(self, prefix: Sequence[int]) -> torch.Tensor:
        """int32 [1, words]: the bitmask of the tokens allowed after `prefix` (the output's first tokens; bit i of
        word w allows token 32 w + i), as the engine hands the verifier a row's."""
        state = self._compiler.compile(self.constraint)
        state.advance(list(prefix))
        return torch.from_numpy(np.array(state.allowed_mask(), dtype=np.int32)).unsqueeze(0)


class TargetReference:
    """p( . | prompt + prefix) from one plain forward of the target model (`model_runtime.model.CausalLM`)
    in a small KV pool of its own, through the request's sampling transform (after its logit_bias and its
    constraint's mask, `masks`, when it has them)."""

    def __init__(self, model: CausalLM, sampling: SamplingParams, block_size: int = 16,
                 masks: ConstraintMasks | None = None) -> None:
        self.model = model
        self.sampling = sampling
        self.block_size = block_size
        self.masks = masks

    def probs(self, prompt_ids: Sequence[int], prefix: Sequence[int]) -> torch.Tensor:
        from model_runtime.local_alloc import LocalAllocator, LocalSequence
        from verifier_service.sampling import transform_logits

        tokens = [*prompt_ids, *prefix]
        blocks = -(-len(tokens) // self.block_size)
        alloc = LocalAllocator(blocks, self.block_size)
        kv = self.model.allocate_kv(blocks, self.block_size)
        with torch.inference_mode():
            (logits,) = self.model.forward_seqs([alloc.extend(LocalSequence(), tokens, logits="last")], kv)
        row = logits[-1:].float()
        if self.sampling.logit_bias or self.masks is not None:  # the verifier's own functions, in its order
            from verifier_service.sampling import apply_allowed, apply_logit_bias

            row = apply_logit_bias(row, self.sampling.logit_bias)
            if self.masks is not None:
                row = apply_allowed(row, self.masks.words(prefix).to(row.device))
        return transform_logits(row, self.sampling)[0].double().cpu()


def engine_target_model(engine: SpecEngine) -> CausalLM:
    """The target model object of an in-process engine's verifier (weights, dtype and device as it runs)."""
    from verifier_service.worker import LocalRunner, VerifierWorker

    verifier = engine.verifier
    if not isinstance(verifier, VerifierWorker) or not isinstance(verifier.runner, LocalRunner):
        raise SpecServeError("the in-process check needs a local verifier (VerifierWorker over a LocalRunner)")
    return verifier.runner.rank.model


def inject_bias(verifier: object) -> None:
    """The negative control: the in-process verifier (an engine's `verifier`, before its first round) resamples from
    p instead of the residual after a rejection, and on a token tree keeps rejected candidates in the target
    (`VerifierWorker.inject_bias`): the check must then fail."""
    from verifier_service.worker import VerifierWorker

    if not isinstance(verifier, VerifierWorker):
        raise SpecServeError("--inject-bias needs the in-process verifier")
    verifier.inject_bias = True
