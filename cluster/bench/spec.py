"""`specserve bench spec`: end-to-end speculative decoding against plain decoding and transformers.

Glossary (figures in the JSON; docs/contracts.md):
  config          one engine setting: draft ("none" = plain decoding, "model", "ngram", "suffix"), k (int or
                  auto), temperature (0 -> greedy contract, > 0 -> exact), batch (concurrent requests); for
                  "suffix" and "model" also the tree limit (tree_nodes: 0 = chains only, N = token trees of up to
                  N nodes; default 16, the engine's)
  tokens/s        output tokens / wall seconds, prefill included (as for transformers' generate)
  vs_plain        tokens/s over our plain decoding (draft none) at the same temperature and batch
  vs_hf           tokens/s over transformers' peer at the same temperature: assisted generation with
                  the same draft model for "model", prompt lookup for "ngram", plain generate for
                  "none"; transformers runs one prompt at a time (its assisted generation is batch 1)
  survival        s_k per draft position k, from the engine's acceptance statistics
  time split      the engine's draft / verify / reconcile seconds; `plan_other` is the rest of the
                  rounds (planning incl. n-gram lookup, reserve, commit), `outside` = wall - rounds

Measurement order: at batch 1 every prompt runs through every config and transformers mode
before the next prompt (rotating the order), so load from other processes falls on all of them
alike. Each run gets a fresh engine (fresh KV ledger, so no prefix cache across runs) that shares
the loaded workers; the auto policy's cost model and acceptance carry over between runs of the
same config, as in a long-running server.

The transformers peer is loaded as a CPU user loads these models: `AutoModelForCausalLM.from_pretrained` of the
checkpoint in bfloat16 (`--hf-dtype`, default bfloat16: the dtype Qwen2.5 and SmolLM2 are published in, which
`torch_dtype="auto"` gives), weights of its own (a second copy beside ours), its default attention. Our prepared
checkpoints hold the GGUF's values dequantized (the hubs are out of reach here), so its weights are those values
rounded to bfloat16: the published checkpoint's own bf16 weights differ from them by the q4 rounding, not in size
or speed. Before 2026-12-07 it shared our q4 model's dequantized float32 tensors, which on an AMD EPYC ran MKL's
float32 few-row products at about half the speed of its bfloat16 (issue 73): its "x transformers" figures were ~2x
too kind.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.bench.bench_prompts import WARMUP_TOKENS, BenchPrompt, load_prompts
from cluster.bench.llamacpp import LlamaCppJob, require_llama_cpp
from cluster.bench.llamacpp_native import require_binaries
from cluster.bench.runtime import environment, progress, set_threads
from cluster.bench.spec_llamacpp import bin_dir, llamacpp_peer, llamacpp_run, run_llamacpp_only
from cluster.bench.spec_settings import SpecSettings
from cluster.bench.spec_tally import Tally, acc_rate, category_ratios, ratio, same_fraction
from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.engine import SpecEngine
from cluster.engine.factory import fresh_engine, tokenize_prompt
from cluster.engine.request_span import RequestSpan
from cluster.engine.round_spans import RoundSpans
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

TREE_DRAFTS = ("suffix", "model")  # draft kinds whose rounds may be token trees
HF_PEER = {"none": "plain", "model": "assisted", "ngram": "prompt_lookup", "suffix": "prompt_lookup"}


def hf_model_as_users_load(checkpoint_dir: str | Path, dtype: str) -> torch.nn.Module:
    """transformers' CausalLM from `checkpoint_dir` in `dtype` ("auto": the checkpoint config's), on the CPU."""
    from transformers import AutoModelForCausalLM

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch_dtype).eval()


@dataclass(frozen=True)
class Config:
    draft: str  # "none" | "model" | "ngram" | "suffix"
    k: int | None  # None = auto; 0 for plain decoding
    temperature: float
    batch: int
    traced: bool = False  # request + round spans at sampling ratio 1.0 (--tracing-overhead)
    tree_nodes: int = 0  # "suffix", "model": the engine's tree limit (0: chains only)
    stop_below: float | None = None  # "model" at k auto: the engine's draft_stop_below (None: its default)
    lookup: bool | None = None  # "model" at k auto: the engine's draft_lookup (None: its default)
    exact_rule: str | None = None  # temperature > 0: the engine's exact_rule (None: its default)
    logprobs: int | None = None  # every request asks for its tokens' log-probabilities, this many alternatives

    @property
    def label(self) -> str:
        label = "plain" if self.draft == "none" else f"{self.draft} k={'auto' if self.k is None else self.k}"
        if self.draft in TREE_DRAFTS:
            label += f" tree<={self.tree_nodes}" if self.tree_nodes else " chain"
        if self.stop_below is not None:
            label += f" stop<{self.stop_below:g}"
        if self.lookup is not None:
            label += " +lookup" if self.lookup else " -lookup"
        if self.exact_rule is not None:
            label += f" {self.exact_rule}"
        if self.logprobs is not None:
            label += f" +logprobs{self.logprobs}"
        return label + (" +traced" if self.traced else "")


class SpecBench:
    """Owner of the loaded workers, the transformers twins and every tally of one benchmark run."""

    def __init__(self, s: SpecSettings) -> None:
        from cluster.engine.factory import build_local_engine, model_dir
        from cluster.serving.config import NGRAM_DRAFT, make_config

        self.s = s
        settings = make_config(  # KV pools for the largest batch of full contexts; "none" is in process only
            model=s.model, draft=NGRAM_DRAFT if s.draft == "none" else s.draft, max_batch=max(s.batches),
            max_context=s.max_context, kv_blocks=None, dtype=s.dtype, draft_dtype=s.draft_dtype,
            warm_up=True)
        progress(f"spec: loading {s.model} (draft {s.draft})")
        self.base = build_local_engine(s.model, s.draft, settings.engine_config(), settings.local_runtime())
        # what auto resolved to (model_runtime/precision.py: on AMX the largest batch decides the target's)
        progress("spec: " + ", ".join(f"{role} {dtype}" for role, dtype in self.base.dtypes.items()))
        self.prompts = load_prompts(s.categories, s.per_category)
        self.prompt_ids = {p.id: tokenize_prompt(self.base.tokenizer, p.text, chat=True) for p in self.prompts}
        self.hf_target = self.hf_draft = None
        if s.hf:  # as a CPU user loads them: weights of their own, in the published dtype (the module docstring)
            self.hf_target = hf_model_as_users_load(model_dir(s.model), s.hf_dtype)
            if self.base.drafter is not None:
                self.hf_draft = hf_model_as_users_load(model_dir(s.draft), s.hf_dtype)
        self.tallies: dict[Config, Tally] = {}
        self.hf_tallies: dict[tuple[str, float], Tally] = {}
        # auto policy state carried per config: the cost model, the drafter's and the lookups' acceptance
        self.policy: dict[Config, tuple[Any, AcceptanceStats | None, AcceptanceStats | None]] = {}
        self.tracer = trace_file_tracer() if s.tracing_overhead else None
        self.llamacpp = llamacpp_peer(s, self.base.eos_token_ids) if s.llamacpp and 0.0 in s.temperatures else None

    # ------------------------------------------------------------------ our engine
    def _fresh_engine(self, config: Config) -> SpecEngine:
        base = self.base
        # the auto policy's state carried per config; else the costs the base engine measured in its warm-up
        cost, acceptance, lookup = self.policy.get(config, (copy.deepcopy(base.cost), None, None))
        engine_config = dataclasses.replace(
            base.config, max_batch=config.batch,
            **{"model_tree_nodes" if config.draft == "model" else "tree_nodes": config.tree_nodes},
            **({} if config.stop_below is None else {"draft_stop_below": config.stop_below}),
            **({} if config.lookup is None else {"draft_lookup": config.lookup}),
            **({} if config.exact_rule is None else {"exact_rule": config.exact_rule}))
        return fresh_engine(base, engine_config, observer=RoundSpans(self.tracer) if config.traced else None,
                            cost=cost, acceptance=acceptance, lookup_acceptance=lookup)

    def _request(self, config: Config, prompt: BenchPrompt, index: int, max_tokens: int) -> GenerationRequest:
        greedy = config.temperature == 0
        sampling = SamplingParams(temperature=config.temperature, max_tokens=max_tokens,
                                  seed=None if greedy else self.s.seed + index, logprobs=config.logprobs)
        spec = SpecParams(contract="greedy" if greedy else "exact", k=0 if config.draft == "none" else config.k,
                          draft=config.draft)
        return GenerationRequest(f"{prompt.id}", tuple(self.prompt_ids[prompt.id]), sampling, spec)

    def run_ours(self, config: Config, prompts: list[BenchPrompt], warmup: bool = False) -> None:
        """One engine run of `prompts` (all submitted at once); a warm-up run records nothing."""
        engine = self._fresh_engine(config)  # traced: round spans per step, as a traced server pays
        max_tokens = WARMUP_TOKENS if warmup else self.s.max_tokens
        spans: dict[str, RequestSpan] = {}
        start = time.perf_counter()
        for p in prompts:
            request = self._request(config, p, self.prompts.index(p), max_tokens)
            if config.traced:
                spans[p.id] = RequestSpan.start("chat", self.s.model, request.sampling, p.id, tracer_=self.tracer)
                request = dataclasses.replace(request, trace_context=spans[p.id].carrier())
            engine.submit(request)
        chunks = engine.run_to_completion()
        for rid, span in spans.items():
            span.finish(self.s.model, [chunks[rid][-1].stats], [chunks[rid][-1].finish_reason])
        wall = time.perf_counter() - start
        engine.kv.audit().assert_no_leaks()
        if warmup:
            return
        self.policy[config] = (engine.cost, engine.acceptance, engine.lookup_acceptance)
        tally = self.tallies.setdefault(config, Tally())
        tally.loadavg.append(os.getloadavg()[0])
        tokens = 0
        for p in prompts:
            out = [t for c in chunks[p.id] for t in c.token_ids]
            tally.outputs[p.id] = out
            tokens += len(out)
            final = chunks[p.id][-1].stats or {}
            acc = AcceptanceStats.from_dict(final["acceptance"]) if final.get("acceptance") else AcceptanceStats()
            tally.acceptance = tally.acceptance.merge(acc)
            tally.acceptance_by_category[p.category] = tally.acceptance_by_category.get(
                p.category, AcceptanceStats()).merge(acc)
            for event in final.get("policy_events", []):
                reason = event["reason"].split(" (")[0]
                tally.policy_reasons[reason] = tally.policy_reasons.get(reason, 0) + 1
        tally.add(prompts[0].category if len(prompts) == 1 else None, tokens, wall)
        stats = engine.stats()
        tally.add_stops(stats)
        split = {"draft": stats["draft_seconds"], "verify": stats["verify_seconds"],
                 "reconcile": stats["reconcile_seconds"]}
        split["plan_other"] = stats["round_seconds"] - sum(split.values())
        split["outside"] = wall - stats["round_seconds"]
        for name, seconds in split.items():
            tally.split[name] = tally.split.get(name, 0.0) + seconds
        what = prompts[0].id if len(prompts) == 1 else f"{len(prompts)} prompts"
        acc_note = f", acceptance {acc_rate(stats):.2f}" if stats["acceptance"]["proposed"] else ""
        progress(f"spec: T={config.temperature} batch {config.batch} {what}: {config.label}: {tokens} tokens in "
                 f"{wall:.1f} s ({tokens / wall:.2f} tok/s{acc_note})")

    # ------------------------------------------------------------------ transformers
    def hf_modes(self) -> list[str]:
        if self.hf_target is None:
            return []
        return ["plain"] + (["assisted"] if "model" in self.s.drafts and self.hf_draft is not None else []) + (
            ["prompt_lookup"] if {"ngram", "suffix"} & set(self.s.drafts) else [])

    def run_hf(self, mode: str, temperature: float, prompt: BenchPrompt, warmup: bool = False) -> None:
        from transformers import GenerationConfig

        eos = sorted(self.base.eos_token_ids)
        options: dict[str, Any] = dict(max_new_tokens=WARMUP_TOKENS if warmup else self.s.max_tokens,
                                       eos_token_id=eos, pad_token_id=eos[0], repetition_penalty=1.0)
        if temperature > 0:  # plain temperature sampling, as our SamplingParams(temperature=T)
            options.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            options.update(do_sample=False)
        if mode == "prompt_lookup":
            options["prompt_lookup_num_tokens"] = self.s.hf_lookup_tokens
        extra = {"assistant_model": self.hf_draft} if mode == "assisted" else {}
        gen = GenerationConfig(**options)
        ids = torch.tensor([self.prompt_ids[prompt.id]])
        torch.manual_seed(self.s.seed + self.prompts.index(prompt))
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.hf_target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, **extra)
        wall = time.perf_counter() - start
        if warmup:
            return
        new = out[0, ids.shape[1]:].tolist()
        tally = self.hf_tallies.setdefault((mode, temperature), Tally())
        tally.loadavg.append(os.getloadavg()[0])
        tally.outputs[prompt.id] = new
        tally.add(prompt.category, len(new), wall)
        progress(f"spec: T={temperature} batch 1 {prompt.id}: transformers {mode}: {len(new)} tokens in {wall:.1f} s "
                 f"({len(new) / wall:.2f} tok/s)")

    # ------------------------------------------------------------------ the plan
    def configs(self, temperature: float, batch: int) -> list[Config]:
        spec = [Config(d, k, temperature, batch, tree_nodes=n, stop_below=x, lookup=lu, exact_rule=r)
                for d in self.s.drafts for k in self.s.ks
                for n in (self.s.tree_nodes if d in TREE_DRAFTS else [0])
                for x in (self.s.draft_stop_below if d == "model" and k is None and self.s.draft_stop_below else [None])
                for lu in (self.s.draft_lookup if d == "model" and k is None and self.s.draft_lookup else [None])
                for r in (self.s.exact_rule if temperature > 0 and self.s.exact_rule else [None])]
        configs = [Config("none", 0, temperature, batch), *spec]
        if self.s.tracing_overhead:
            configs += [dataclasses.replace(c, traced=True) for c in configs]
        if self.s.logprobs_overhead is not None:
            configs += [dataclasses.replace(c, logprobs=self.s.logprobs_overhead) for c in configs if not c.traced]
        return configs

    def warm_up(self) -> None:
        """Untimed short runs of every code path first (kernel selection, lazy allocations)."""
        progress("spec: warm-up")
        first = self.prompts[:1]
        for temperature in self.s.temperatures:
            traced = [True] if self.s.tracing_overhead else []
            for config in self.configs(temperature, 1)[:1] + [
                    Config(d, 2, temperature, 1, t, max(self.s.tree_nodes) if d in TREE_DRAFTS else 0)
                    for d in self.s.drafts for t in [False, *traced]]:
                self.run_ours(config, first, warmup=True)
            for mode in self.hf_modes():
                self.run_hf(mode, temperature, first[0], warmup=True)
            for job in self.llamacpp_jobs(temperature):
                self.run_llamacpp(job, first[0], warmup=True)

    def run(self) -> dict[str, Any]:
        self.warm_up()
        for temperature in self.s.temperatures:
            for batch in self.s.batches:
                configs = self.configs(temperature, batch)
                if batch == 1:
                    self._interleaved(configs, temperature)
                else:
                    self._repeated(configs)
        return self.report()

    def _repeated(self, configs: list[Config]) -> None:
        """Batch > 1: every config runs all prompts at once, `repeats` times, the order rotating each time, so a
        slow spell of the shared machine falls on every config alike; a config's figures sum its runs."""
        for r in range(self.s.repeats):
            if self.s.repeats > 1:
                progress(f"spec: batch {configs[0].batch}: repeat {r + 1}/{self.s.repeats}")
            shift = r % len(configs)
            for config in configs[shift:] + configs[:shift]:
                self.run_ours(config, self.prompts)

    def _interleaved(self, configs: list[Config], temperature: float) -> None:
        jobs: list[Config | str | LlamaCppJob] = [*configs, *self.hf_modes(), *self.llamacpp_jobs(temperature)]
        for i, prompt in enumerate(self.prompts):
            progress(f"spec: T={temperature} batch 1: prompt {i + 1}/{len(self.prompts)} ({prompt.id}, "
                     f"{len(self.prompt_ids[prompt.id])} prompt tokens)")
            shift = i % len(jobs)
            for job in jobs[shift:] + jobs[:shift]:
                if isinstance(job, Config):
                    self.run_ours(job, [prompt])
                elif isinstance(job, LlamaCppJob):
                    self.run_llamacpp(job, prompt)
                else:
                    self.run_hf(job, temperature, prompt)

    def report(self) -> dict[str, Any]:
        results = []
        for config, tally in self.tallies.items():
            row: dict[str, Any] = {"label": config.label, "draft": config.draft,
                                   "k": "auto" if config.k is None else config.k, "tree_nodes": config.tree_nodes,
                                   "draft_stop_below": config.stop_below, "draft_lookup": config.lookup,
                                   "exact_rule": config.exact_rule,
                                   "temperature": config.temperature, "batch": config.batch,
                                   "contract": "greedy" if config.temperature == 0 else "exact", **tally.summary()}
            plain = self.tallies[Config("none", 0, config.temperature, config.batch)]
            row["speedup_vs_plain"] = ratio(tally, plain)
            row["traced"] = config.traced
            if config.traced:  # tokens/s traced / untraced, the same config in the same run
                row["speedup_vs_untraced"] = ratio(tally, self.tallies[dataclasses.replace(config, traced=False)])
            row["logprobs"] = config.logprobs
            if config.logprobs is not None:  # tokens/s with log-probabilities / without, same config, same run
                row["speedup_vs_no_logprobs"] = ratio(tally, self.tallies[dataclasses.replace(config, logprobs=None)])
            row["by_category_speedup_vs_plain"] = category_ratios(tally, plain)
            hf_plain = self.hf_tallies.get(("plain", config.temperature))
            peer = self.hf_tallies.get((HF_PEER[config.draft], config.temperature))
            row["hf_peer"] = HF_PEER[config.draft] if peer else None
            row["speedup_vs_hf_plain"] = ratio(tally, hf_plain) if hf_plain else None
            row["speedup_vs_hf_peer"] = ratio(tally, peer) if peer else None
            row["by_category_speedup_vs_hf_peer"] = category_ratios(tally, peer) if peer else {}
            if config.temperature == 0 and config.draft != "none":  # greedy contract: output == plain decoding
                row["same_output_as_plain"] = same_fraction(tally, plain)
            results.append(row)
        hf = []
        for (mode, temperature), tally in self.hf_tallies.items():
            row = {"mode": mode, "temperature": temperature, "batch": 1, **tally.summary()}
            hf_plain = self.hf_tallies.get(("plain", temperature))
            row["speedup_vs_hf_plain"] = ratio(tally, hf_plain) if hf_plain else None
            ours_plain = self.tallies.get(Config("none", 0, temperature, 1))
            if temperature == 0 and mode == "plain" and ours_plain:
                row["same_output_as_our_plain"] = same_fraction(tally, ours_plain)
            hf.append(row)
        s = dataclasses.asdict(self.s)
        s["ks"] = ["auto" if k is None else k for k in self.s.ks]
        return {"bench": "spec", "settings": s, "engine_config": dataclasses.asdict(self.base.config),
                "dtypes": dict(self.base.dtypes),
                "hf_settings": {"hf_batch": 1, "weights": f"its own copy, {self.s.hf_dtype}",
                                "dtype": str(self.hf_target.dtype) if self.hf_target is not None else None,
                                "assisted": "transformers defaults (num_assistant_tokens, schedule,"
                                " confidence threshold)", "prompt_lookup_num_tokens": self.s.hf_lookup_tokens,
                                "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0},
                "prompts": [{"id": p.id, "category": p.category, "prompt_tokens": len(self.prompt_ids[p.id])}
                            for p in self.prompts],
                "results": results, "hf": hf,
                "llamacpp": self.llamacpp_report()}

    # ------------------------------------------------------------------ llama.cpp (greedy, batch 1)
    def llamacpp_jobs(self, temperature: float) -> list[LlamaCppJob]:
        return [LlamaCppJob(m) for m in self.llamacpp.modes()] if self.llamacpp and temperature == 0 else []

    def llamacpp_report(self) -> dict[str, Any] | None:
        if self.llamacpp is None:
            return None
        greedy_plain = self.tallies.get(Config("none", 0, 0.0, 1))  # ours, to compare token ids with
        return self.llamacpp.report(greedy_plain.outputs if greedy_plain else None)

    def run_llamacpp(self, job: LlamaCppJob, prompt: BenchPrompt, warmup: bool = False) -> None:
        assert self.llamacpp is not None
        llamacpp_run(self.llamacpp, job.mode, prompt, self.prompt_ids[prompt.id],
                     WARMUP_TOKENS if warmup else self.s.max_tokens, warmup)


def trace_file_tracer() -> Any:
    """A tracer of its own (not the process's) sampling every span and exporting it as JSON lines to a
    temporary file, as a traced server with `--trace-file` would."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    from specserve_types.tracing import JsonLinesSpanExporter

    path = tempfile.NamedTemporaryFile(prefix="specserve-bench-spans-", suffix=".jsonl", delete=False).name
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(path), schedule_delay_millis=500))
    progress(f"spec: traced configs export their spans to {path}")
    return provider.get_tracer("specserve-bench")


def run_spec_bench(s: SpecSettings) -> dict[str, Any]:
    if s.llamacpp or s.llamacpp_only:  # before any model loads: LlamaCppMissingError says how to get it
        require_llama_cpp() if s.llamacpp_python else require_binaries(bin_dir(s))
    if s.llamacpp_only:
        return run_llamacpp_only(s)
    set_threads(s.threads)
    env = environment()
    bench = SpecBench(s)
    try:
        result = bench.run()
    finally:
        if bench.llamacpp is not None:
            bench.llamacpp.close()
    env["loadavg_at_end"] = list(os.getloadavg())
    result["environment"] = env
    return result


