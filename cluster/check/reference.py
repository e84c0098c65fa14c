"""The reference distribution of `specserve check exact`: the target model alone, one plain forward of
prompt + prefix, the request's sampling transform on its last row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specserve_types.api import SamplingParams, SpecServeError

if TYPE_CHECKING:
    from cluster.engine.engine import SpecEngine
    from model_runtime.model import CausalLM


class TargetReference:
    """p( . | prompt + prefix) from one plain forward of the target model (`model_runtime.model.CausalLM`)
    in a small KV pool of its own, through the request's sampling transform."""

    def __init__(self, model: CausalLM, sampling: SamplingParams, block_size: int = 16) -> None:
        self.model = model
        self.sampling = sampling
        self.block_size = block_size

    def probs(self, prompt_ids: Sequence[int], prefix: Sequence[int]) -> torch.Tensor:
        from model_runtime.local_alloc import LocalAllocator, LocalSequence
        from verifier_service.sampling import transform_logits

        tokens = [*prompt_ids, *prefix]
        blocks = -(-len(tokens) // self.block_size)
        alloc = LocalAllocator(blocks, self.block_size)
        kv = self.model.allocate_kv(blocks, self.block_size)
        with torch.inference_mode():
            (logits,) = self.model.forward_seqs([alloc.extend(LocalSequence(), tokens, logits="last")], kv)
        return transform_logits(logits[-1:].float(), self.sampling)[0].double().cpu()


def engine_target_model(engine: SpecEngine) -> CausalLM:
    """The target model object of an in-process engine's verifier (weights, dtype and device as it runs)."""
    from verifier_service.worker import LocalRunner, VerifierWorker

    verifier = engine.verifier
    if not isinstance(verifier, VerifierWorker) or not isinstance(verifier.runner, LocalRunner):
        raise SpecServeError("the in-process check needs a local verifier (VerifierWorker over a LocalRunner)")
    return verifier.runner.rank.model


def inject_bias(engine: SpecEngine) -> None:
    """The negative control: the in-process verifier resamples from p instead of the residual after a
    rejection, and on a token tree keeps rejected candidates in the target (`VerifierWorker.inject_bias`): the
    check must then fail."""
    from verifier_service.worker import VerifierWorker

    if not isinstance(engine.verifier, VerifierWorker):
        raise SpecServeError("--inject-bias needs the in-process verifier")
    engine.verifier.inject_bias = True
