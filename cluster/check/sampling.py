"""Drawing the samples of `specserve check exact` through the real path, speculation on: in process
through a `SpecEngine`, or through a running cluster with the gRPC client (`cluster/client.py`).

Completion i of prompt j has seed  settings.seed + j * n + i  (`CheckSettings.first_seed`): independent
draws (every uniform is a hash of (seed, position, stream), verifier_service/sampling.py) and
non-overlapping seed ranges across prompts. EOS is ignored, so every sample has max(positions) tokens (under a
constraint, unless it completes sooner: the check then stops with an error naming it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from cluster.check.settings import CheckSettings, PromptSamples
from specserve_types.api import CapacityError, GenerationRequest, SpecServeError

RETRY_FOR_S = 600.0  # how long a call is asked again after capacity refusals (without a timeout of its own)

if TYPE_CHECKING:
    from cluster.engine.engine import SpecEngine

Progress = Callable[[int, int], None]


def _hint(settings: CheckSettings) -> str:
    if settings.constraint is None:
        return ""
    return (f" (under {settings.constraint.field} a sample ends where its constraint completes: the check needs a "
            f"constraint that allows at least {settings.max_tokens} tokens, max(positions))")


def sample_in_process(engine: SpecEngine, prompts: list[PromptSamples], settings: CheckSettings, window: int,
                      progress: Progress | None = None, per_group: int = 16) -> None:
    """Fill `prompts` with settings.n completions each through `engine`, at most `window` requests in the
    engine at a time, submitted as prompt groups of up to `per_group` completions (`SpecEngine.submit_group`:
    the prompt is prefilled once per group, as a request with n > 1 is on the server)."""
    per_group = max(1, min(per_group, window))
    jobs = iter([(j, start, min(per_group, settings.n - start))
                 for j in range(len(prompts)) for start in range(0, settings.n, per_group)])
    total, done, in_flight = len(prompts) * settings.n, 0, 0
    tokens: dict[str, list[int]] = {}
    where: dict[str, tuple[int, int]] = {}
    spec = settings.spec()
    for prompt in prompts:
        prompt.tokens = [()] * settings.n
    job = next(jobs, None)
    while True:
        while job is not None and in_flight + job[2] <= window:
            j, start, count = job
            requests = [GenerationRequest(f"check-{j}-{i}", tuple(prompts[j].prompt_ids),
                                          settings.sampling(prompts[j].first_seed + i), spec, settings.constraint)
                        for i in range(start, start + count)]
            if count == 1:
                engine.submit(requests[0])
            else:
                engine.submit_group(requests)
            for i, request in zip(range(start, start + count), requests, strict=True):
                tokens[request.request_id], where[request.request_id] = [], (j, i)
            in_flight += count
            job = next(jobs, None)
        if in_flight == 0:
            break
        for chunk in engine.step():
            j, i = where[chunk.request_id]
            tokens[chunk.request_id].extend(chunk.token_ids)
            prompts[j].proposed += chunk.proposed
            prompts[j].accepted += chunk.accepted
            prompts[j].forced += chunk.forced
            if chunk.finished:
                got = tokens.pop(chunk.request_id)
                if chunk.finish_reason != "length" or len(got) != settings.max_tokens:
                    raise SpecServeError(f"sample {i} of prompt {j + 1} ended with {chunk.finish_reason!r} after "
                                         f"{len(got)} of {settings.max_tokens} tokens{_hint(settings)}")
                prompts[j].tokens[i] = tuple(got)
                in_flight -= 1
                done += 1
                if progress is not None:
                    progress(done, total)


def sample_via_server(address: str, prompts: list[PromptSamples], settings: CheckSettings, per_call: int,
                      concurrency: int, progress: Progress | None = None, timeout_s: float | None = None) -> None:
    """Fill `prompts` through a running cluster's gRPC endpoint: calls of n <= per_call completions (the
    server gives completion m of a call seed + m), `concurrency` calls at a time."""
    from cluster.client import SpecServeClient, collect

    calls = [(j, start, min(per_call, settings.n - start))
             for j in range(len(prompts)) for start in range(0, settings.n, per_call)]
    total, done = len(prompts) * settings.n, 0
    for prompt in prompts:
        prompt.tokens = [()] * settings.n
    fields = dict(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                  max_tokens=settings.max_tokens, ignore_eos=True, contract=settings.contract, k=settings.k,
                  draft=settings.draft, constraint=settings.constraint, logit_bias=settings.logit_bias)
    with SpecServeClient(address, timeout_s=timeout_s) as client:

        def call(j: int, start: int, count: int) -> tuple[int, int, dict[int, dict[str, Any]]]:
            # a server full, or this client past its share (docs/limits.md: `concurrency` calls of `per_call`
            # completions may be more than one client's share), refuses at admission: wait as it says and ask again
            deadline = time.monotonic() + (timeout_s or RETRY_FOR_S)
            while True:
                stream = client.generate(prompts[j].prompt_ids, seed=prompts[j].first_seed + start, n=count, **fields)
                try:
                    return j, start, collect(stream)
                except CapacityError as full:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(full.retry_after_s or 1.0)

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for j, start, samples in pool.map(lambda c: call(*c), calls):
                for m, sample in samples.items():
                    got = sample["token_ids"]
                    if sample["finish_reason"] != "length" or len(got) != settings.max_tokens:
                        raise SpecServeError(f"sample {start + m} of prompt {j + 1} ended with "
                                             f"{sample['finish_reason']!r} after {len(got)} tokens{_hint(settings)}")
                    prompts[j].tokens[start + m] = tuple(got)
                    prompts[j].proposed += sample["proposed"]
                    prompts[j].accepted += sample["accepted"]
                    prompts[j].forced += sample["forced"]
                done += len(samples)
                if progress is not None:
                    progress(done, total)
