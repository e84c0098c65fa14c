"""`specserve check exact`: an end-to-end statistical test that speculative sampling emits the target's
distribution, on the user's own models, dtypes and kernels (in process) or cluster (`--server`).

    sample     N completions of max(positions) tokens per prompt through the real path, speculation on
               (cluster/check/sampling.py): in process through `build_local_engine`, or through a running
               cluster with the gRPC client.
    reference  per position, the target model alone on prompt + the modal prefix (cluster/check/reference.py):
               in process the engine's own target model object (same weights, dtype, device); with
               --server the target loaded here (cpu, float32). Under a constraint, its mask along the prefix
               (compiled here as the engine compiles it) and the logit bias come before the transform.
    judge      Pearson's chi-square with pooled cells, p-value, total variation, power against a stated
               total variation (cluster/check/report.py, cluster/check/stats.py).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cluster.check.reference import ConstraintMasks, TargetReference, engine_target_model, inject_bias
from cluster.check.report import CheckReport, judge
from cluster.check.sampling import Progress, sample_in_process, sample_via_server
from cluster.check.settings import CheckSettings, PromptSamples
from specserve_types.api import SpecServeError


def run_check(prompts: list[PromptSamples], reference: TargetReference, settings: CheckSettings,
              sample: Callable[[], None], model: str, draft: str, where: str, biased: bool) -> CheckReport:
    """Sample (`sample` fills `prompts`), then judge every (prompt, position)."""
    start = time.perf_counter()
    sample()
    sampled = time.perf_counter()
    results = [judge(j, t, prompts[j], reference, settings)
               for j in range(len(prompts)) for t in sorted(set(settings.positions))]
    return CheckReport(model, draft, where, settings, prompts, results, biased, sampled - start,
                       time.perf_counter() - sampled)


def _prompts(tokenizer: Any, texts: Sequence[str], chat: bool, settings: CheckSettings) -> list[PromptSamples]:
    from cluster.engine.factory import tokenize_prompt

    if not texts:
        raise SpecServeError("prompt: need at least one prompt")
    return [PromptSamples(text, tokenize_prompt(tokenizer, text, chat), settings.first_seed(j))
            for j, text in enumerate(texts)]


def _masks(settings: CheckSettings, checkpoint: Path, tokenizer: Any) -> ConstraintMasks | None:
    """The reference's constraint masks, over the target's vocabulary and EOS ids as the engine's (factory.py)."""
    from cluster.engine.factory import eos_token_ids
    from model_runtime.config import ModelConfig

    if settings.constraint is None:
        return None
    config = ModelConfig.from_dir(checkpoint)
    return ConstraintMasks(settings.constraint, tokenizer, config.vocab_size,
                           eos_token_ids(checkpoint, config, tokenizer))


def check_in_process(model: str, draft: str, texts: Sequence[str], settings: CheckSettings, *, chat: bool = False,
                     window: int = 16, per_group: int = 16, draft_dtype: str | None = None, device: str | None = None,
                     dtype: str | None = None, tree_nodes: int | None = None, model_tree_nodes: int | None = None,
                     exact_rule: str | None = None, biased: bool = False, progress: Progress | None = None) -> tuple[CheckReport, Any]:
    """The check through an engine built here (`build_local_engine`), at most `window` requests at a time, in
    prompt groups of up to `per_group` completions (one prefill each).
    `draft` is 'ngram', 'suffix' or a draft model; `biased` turns on the negative control. Returns the report and the
    target's tokenizer."""
    from cluster.engine.factory import build_local_engine, load_tokenizer, model_dir
    from cluster.serving.config import make_config

    if (draft if draft in ("ngram", "suffix") else "model") != settings.draft:
        raise SpecServeError(f"draft: settings.draft {settings.draft!r} does not match draft {draft!r}")
    tokenizer = load_tokenizer(model_dir(model))
    prompts = _prompts(tokenizer, texts, chat, settings)
    masks = _masks(settings, model_dir(model), tokenizer)  # a bad constraint fails here, before the models load
    longest = max(len(p.prompt_ids) for p in prompts) + settings.max_tokens
    given = {key: value for key, value in (("draft_dtype", draft_dtype), ("device", device), ("dtype", dtype),
                                           ("tree_nodes", tree_nodes), ("model_tree_nodes", model_tree_nodes),
                                           ("exact_rule", exact_rule))
             if value is not None}
    defaults = make_config(**{k: v for k, v in given.items() if "tree" in k})
    k_max = settings.k if settings.k is not None else defaults.k_max
    # a tree reserves a slot per node
    k_max = max(k_max, defaults.tree_nodes if settings.draft == "suffix" else defaults.model_tree_nodes)
    # KV pools for `window` requests of the longest prompt (ClusterConfig's block size), not for full contexts
    blocks = window * (-(-(longest + k_max + 1) // defaults.block_size) + 1) + 16
    config = make_config(model=model, draft=draft, max_batch=window, queue_capacity=window, kv_blocks=max(8, blocks),
                         max_context=max(64, longest + k_max + 1), warm_up=False, **given)
    engine = build_local_engine(model, draft, config.engine_config(), config.local_runtime(), tokenizer=tokenizer)
    try:
        if biased:
            inject_bias(engine.verifier)
        reference = TargetReference(engine_target_model(engine), settings.sampling(), masks=masks)
        report = run_check(prompts, reference, settings,
                           lambda: sample_in_process(engine, prompts, settings, window, progress, per_group),
                           model, draft, "in process", biased)
        if engine.acceptance.tree_rounds or settings.draft == "suffix":
            a = engine.acceptance
            report = dataclasses.replace(report, trees={"rounds": a.rounds, "tree_rounds": a.tree_rounds,
                                                        "tree_nodes": a.tree_nodes,
                                                        "accepted_by_rank": list(a.accepted_by_rank)})
        if engine.lookup_acceptance.rounds:
            lk = engine.lookup_acceptance
            report = dataclasses.replace(report, lookups={"rounds": engine.acceptance.rounds + lk.rounds,
                                                          "lookup_rounds": lk.rounds, "proposed": lk.proposed,
                                                          "accepted": lk.accepted})
    finally:
        engine.close()
    return report, tokenizer


def check_via_server(address: str, model: str, draft: str, texts: Sequence[str], settings: CheckSettings, *,
                     chat: bool = False, per_call: int = 16, concurrency: int = 4, timeout_s: float | None = None,
                     progress: Progress | None = None, dtype: str = "auto") -> tuple[CheckReport, Any]:
    """The check through a running cluster's gRPC endpoint; `model` must name the served target (the reference
    runs it here, on the cpu, in `dtype`: the server's)."""
    from cluster.client import SpecServeClient
    from cluster.engine.factory import load_tokenizer, model_dir
    from model_runtime.model import CausalLM
    from model_runtime.precision import target_dtype

    with SpecServeClient(address, timeout_s=timeout_s) as client:
        served = [m["id"] for m in client.list_models() if m["role"] == "target"]
    if model not in served:
        raise SpecServeError(f"model: the server at {address} serves {', '.join(served) or 'no target'}; --model "
                             "must name that target (the reference distribution is computed from it here)")
    checkpoint = model_dir(model)
    tokenizer = load_tokenizer(checkpoint)
    prompts = _prompts(tokenizer, texts, chat, settings)
    masks = _masks(settings, checkpoint, tokenizer)
    reference = TargetReference(CausalLM.load(checkpoint, dtype=target_dtype(dtype, "cpu", checkpoint), device="cpu"),
                                settings.sampling(), masks=masks)
    report = run_check(prompts, reference, settings,
                       lambda: sample_via_server(address, prompts, settings, per_call, concurrency, progress,
                                                 timeout_s),
                       model, draft, f"server {address}", False)
    return report, tokenizer


def stderr_progress(label: str) -> Progress:
    """Progress on stderr: a rewritten line on a terminal, otherwise a line per 10%."""
    tty = sys.stderr.isatty()
    state = {"last": 0.0, "decile": -1}

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if tty:
            if done == total or now - state["last"] >= 0.5:
                state["last"] = now
                print(f"\r{label}: {done}/{total} samples", end="\n" if done == total else "", file=sys.stderr,
                      flush=True)
        elif (decile := 10 * done // total) > state["decile"]:
            state["decile"] = decile
            print(f"{label}: {done}/{total} samples", file=sys.stderr, flush=True)

    return report
