"""`specserve bench spec`: end-to-end speculative decoding against plain decoding and transformers.

Glossary (figures in the JSON; docs/ARCHITECTURE.md §5):
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
same config, as in a long-running server. Transformers models share our weight tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cluster.bench.llamacpp import LlamaCppJob, LlamaCppSettings, require_llama_cpp
from cluster.bench.llamacpp_native import NativeLlamaCpp, require_binaries
from cluster.bench.llamacpp_process import LlamaCppProcess
from cluster.bench.runtime import environment, hf_model_sharing_weights, progress, set_threads
from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.engine import SpecEngine
from cluster.engine.factory import tokenize_prompt
from cluster.engine.kv_client import LocalKV
from cluster.engine.request_span import RequestSpan
from cluster.engine.round_spans import RoundSpans
from kv_manager.ledger import BlockLedger
from model_runtime.model import CausalLM
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

PROMPTS_PATH = Path(__file__).parent / "prompts" / "bench_prompts.jsonl"
CATEGORIES = ("prose", "code", "qa", "summarisation", "copy-edit")
WARMUP_TOKENS = 4
TREE_DRAFTS = ("suffix", "model")  # draft kinds whose rounds may be token trees
HF_PEER = {"none": "plain", "model": "assisted", "ngram": "prompt_lookup", "suffix": "prompt_lookup"}


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str


def load_prompts(categories: list[str], per_category: int, path: Path = PROMPTS_PATH) -> list[BenchPrompt]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    unknown = set(categories) - {r["category"] for r in rows}
    if unknown:
        raise ValueError(f"no prompts for categories {sorted(unknown)} in {path}")
    return [BenchPrompt(r["id"], r["category"], r["prompt"])
            for c in categories for r in [r for r in rows if r["category"] == c][:per_category]]


@dataclass
class SpecSettings:
    model: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"  # the draft model; "none" = n-gram only
    drafts: list[str] = field(default_factory=lambda: ["model", "ngram"])
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES))
    per_category: int = 2
    ks: list[int | None] = field(default_factory=lambda: [1, 2, 3, 4, None])  # None = auto
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    batches: list[int] = field(default_factory=lambda: [1, 8])
    max_tokens: int = 64
    threads: int = 2
    seed: int = 1234
    hf: bool = True
    hf_lookup_tokens: int = 10  # transformers' prompt_lookup_num_tokens (its documented example value)
    max_context: int = 1024
    dtype: str = "auto"  # the target's: see model_runtime.precision.target_dtype
    draft_dtype: str = "auto"  # see model_runtime.precision.draft_dtype
    tracing_overhead: bool = False  # also run every config traced (every span sampled, exported to a file)
    llamacpp: bool = False  # also llama.cpp on the same GGUF files, greedy (cluster/bench/llamacpp.py)
    llamacpp_only: bool = False  # llama.cpp alone: neither our engine nor transformers
    llamacpp_draft_tokens: int = 4  # tokens llama.cpp's draft model proposes per round
    llamacpp_bin: str | None = None  # native llama.cpp binaries (default: scripts/build-llamacpp.sh's folder)
    llamacpp_python: bool = False  # llama-cpp-python's Python loop instead (not how llama.cpp's users run it)
    repeats: int = 1  # batch > 1: runs of every config, in rotating order (figures over all runs)
    tree_nodes: list[int] = field(default_factory=lambda: [16])  # "suffix", "model" configs: 0 = chains, N = trees

    def __post_init__(self) -> None:
        if self.draft == "none" and "model" in self.drafts:
            raise ValueError("draft kind 'model' needs a draft model (--draft)")
        assert set(self.drafts) <= {"model", "ngram", "suffix"}, self.drafts
        assert self.tree_nodes and all(0 <= n <= 64 for n in self.tree_nodes), self.tree_nodes
        assert self.ks and all(k is None or 1 <= k <= 8 for k in self.ks), self.ks
        assert all(b >= 1 for b in self.batches) and self.max_tokens >= 1 and self.per_category >= 1
        assert self.repeats >= 1, self.repeats


QUICK = dict(model="smollm2-135m", draft="none", drafts=["ngram"], categories=["code", "qa", "copy-edit"],
             per_category=1, ks=[2, None], temperatures=[0.0], batches=[1], max_tokens=16)


@dataclass(frozen=True)
class Config:
    draft: str  # "none" | "model" | "ngram" | "suffix"
    k: int | None  # None = auto; 0 for plain decoding
    temperature: float
    batch: int
    traced: bool = False  # request + round spans at sampling ratio 1.0 (--tracing-overhead)
    tree_nodes: int = 0  # "suffix", "model": the engine's tree limit (0: chains only)

    @property
    def label(self) -> str:
        label = "plain" if self.draft == "none" else f"{self.draft} k={'auto' if self.k is None else self.k}"
        if self.draft in TREE_DRAFTS:
            label += f" tree<={self.tree_nodes}" if self.tree_nodes else " chain"
        return label + (" +traced" if self.traced else "")


@dataclass
class Tally:
    """Sums over the runs of one config (or one transformers mode)."""

    output_tokens: int = 0
    wall_seconds: float = 0.0
    by_category: dict[str, list[float]] = field(default_factory=dict)  # category -> [tokens, seconds]
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    acceptance_by_category: dict[str, AcceptanceStats] = field(default_factory=dict)
    split: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # prompt id -> output token ids
    loadavg: list[float] = field(default_factory=list)
    policy_reasons: dict[str, int] = field(default_factory=dict)  # why k was chosen, per request change

    def add(self, category: str | None, tokens: int, seconds: float) -> None:
        self.output_tokens += tokens
        self.wall_seconds += seconds
        if category is not None:
            cell = self.by_category.setdefault(category, [0, 0.0])
            cell[0] += tokens
            cell[1] += seconds

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "output_tokens": self.output_tokens, "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.output_tokens / self.wall_seconds if self.wall_seconds else 0.0,
            "by_category": {c: {"output_tokens": int(t), "wall_seconds": s, "tokens_per_second": t / s if s else 0.0}
                            for c, (t, s) in self.by_category.items()},
            "mean_loadavg_1min": sum(self.loadavg) / len(self.loadavg) if self.loadavg else None,
        }
        if self.policy_reasons:
            out["policy_reasons"] = dict(self.policy_reasons)
        if self.acceptance.rounds:
            out["acceptance"] = self.acceptance.to_dict()
            for cat, acc in self.acceptance_by_category.items():
                out["by_category"].setdefault(cat, {})["acceptance"] = acc.to_dict()
        if self.split:
            total = self.wall_seconds or 1.0
            out["time_split_seconds"] = dict(self.split)
            out["time_split_fraction"] = {name: s / total for name, s in self.split.items()}
        return out


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
        self.prompts = load_prompts(s.categories, s.per_category)
        self.prompt_ids = {p.id: tokenize_prompt(self.base.tokenizer, p.text, chat=True) for p in self.prompts}
        self.hf_target = self.hf_draft = None
        if s.hf:
            self.hf_target = hf_model_sharing_weights(self.base.verifier.runner.rank.model, model_dir(s.model))
            if self.base.drafter is not None:
                # transformers' assistant runs in the target's precision (float32, or bfloat16 where this CPU
                # has bf16 instructions), as it would for a CPU user (its float16 has no fast CPU kernels);
                # ours keeps its own draft precision.
                draft = self.base.drafter.runner.rank.model
                target = self.base.verifier.runner.rank.model
                if draft.dtype != target.dtype:
                    draft = CausalLM.load(model_dir(s.draft), dtype=target.dtype)
                self.hf_draft = hf_model_sharing_weights(draft, model_dir(s.draft))
        self.tallies: dict[Config, Tally] = {}
        self.hf_tallies: dict[tuple[str, float], Tally] = {}
        self.policy: dict[Config, tuple[Any, AcceptanceStats]] = {}  # auto policy state carried per config
        self.tracer = trace_file_tracer() if s.tracing_overhead else None
        self.llamacpp = llamacpp_peer(s, self.base.eos_token_ids) if s.llamacpp and 0.0 in s.temperatures else None

    # ------------------------------------------------------------------ our engine
    def _fresh_engine(self, config: Config) -> SpecEngine:
        base = self.base
        namespaces = [pool.config for pool in base.kv.inner.ledger.pools.values()]
        # the auto policy's state carried per config; else the costs the base engine measured in its warm-up
        cost, acceptance = self.policy.get(config, (copy.deepcopy(base.cost), None))
        return SpecEngine(base.verifier, base.drafter, LocalKV(BlockLedger(namespaces)), base.tokenizer,
                          tuple(base.eos_token_ids), base.vocab_size,
                          dataclasses.replace(base.config, max_batch=config.batch,
                                              **{"model_tree_nodes" if config.draft == "model" else "tree_nodes":
                                                 config.tree_nodes}),
                          model_name=base.model_name, draft_name=base.draft_name, dtypes=base.dtypes,
                          observer=RoundSpans(self.tracer) if config.traced else None, cost=cost,
                          acceptance=acceptance)

    def _request(self, config: Config, prompt: BenchPrompt, index: int, max_tokens: int) -> GenerationRequest:
        greedy = config.temperature == 0
        sampling = SamplingParams(temperature=config.temperature, max_tokens=max_tokens,
                                  seed=None if greedy else self.s.seed + index)
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
        self.policy[config] = (engine.cost, engine.acceptance)
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
        spec = [Config(d, k, temperature, batch, tree_nodes=n) for d in self.s.drafts for k in self.s.ks
                for n in (self.s.tree_nodes if d in TREE_DRAFTS else [0])]
        configs = [Config("none", 0, temperature, batch), *spec]
        if self.s.tracing_overhead:
            configs += [dataclasses.replace(c, traced=True) for c in configs]
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
                                   "temperature": config.temperature, "batch": config.batch,
                                   "contract": "greedy" if config.temperature == 0 else "exact", **tally.summary()}
            plain = self.tallies[Config("none", 0, config.temperature, config.batch)]
            row["speedup_vs_plain"] = ratio(tally, plain)
            row["traced"] = config.traced
            if config.traced:  # tokens/s traced / untraced, the same config in the same run
                row["speedup_vs_untraced"] = ratio(tally, self.tallies[dataclasses.replace(config, traced=False)])
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
                "hf_settings": {"hf_batch": 1, "assisted": "transformers defaults (num_assistant_tokens, schedule,"
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


def acc_rate(stats: dict[str, Any]) -> float:
    return stats["acceptance"]["acceptance_rate"]


def ratio(a: Tally, b: Tally) -> float | None:
    if not (a.wall_seconds and b.wall_seconds and b.output_tokens):
        return None
    return (a.output_tokens / a.wall_seconds) / (b.output_tokens / b.wall_seconds)


def category_ratios(a: Tally, b: Tally) -> dict[str, float]:
    out = {}
    for cat, (tokens, seconds) in a.by_category.items():
        if cat in b.by_category and seconds and b.by_category[cat][0] and b.by_category[cat][1]:
            out[cat] = (tokens / seconds) / (b.by_category[cat][0] / b.by_category[cat][1])
    return out


def same_fraction(a: Tally, b: Tally) -> float | None:
    common = [pid for pid in a.outputs if pid in b.outputs]
    return sum(a.outputs[pid] == b.outputs[pid] for pid in common) / len(common) if common else None


def run_spec_bench(s: SpecSettings) -> dict[str, Any]:
    if s.llamacpp or s.llamacpp_only:  # before any model loads: LlamaCppMissingError says how to get it
        require_llama_cpp() if s.llamacpp_python else require_binaries(_bin_dir(s))
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


# ---------------------------------------------------------------------- llama.cpp
def _bin_dir(s: SpecSettings) -> Path | None:
    return Path(s.llamacpp_bin) if s.llamacpp_bin else None


def llamacpp_peer(s: SpecSettings, eos_token_ids: Any) -> NativeLlamaCpp | LlamaCppProcess:
    """llama.cpp on the GGUF files `s.model` and `s.draft` are prepared from; modes follow `s.drafts`. Native
    binaries (cluster/bench/llamacpp_native.py) unless `s.llamacpp_python` asks for the Python binding's loop."""
    from cluster.bench.gguf_file import gguf_path

    model_draft = s.draft != "none" and "model" in s.drafts
    progress(f"spec: llama.cpp: loading the GGUF files of {s.model}" + (f" and {s.draft}" if model_draft else ""))
    settings = LlamaCppSettings(
        model_gguf=gguf_path(s.model), draft_gguf=gguf_path(s.draft) if model_draft else None, threads=s.threads,
        n_ctx=s.max_context, draft_tokens=s.llamacpp_draft_tokens, lookup_tokens=s.hf_lookup_tokens,
        lookup="ngram" in s.drafts, eos_token_ids=frozenset(eos_token_ids))
    if s.llamacpp_python:
        return LlamaCppProcess(settings)
    return NativeLlamaCpp(settings, _bin_dir(s))


def llamacpp_run(peer: NativeLlamaCpp | LlamaCppProcess, mode: str, prompt: BenchPrompt, prompt_ids: list[int], max_tokens: int,
                 warmup: bool = False) -> None:
    run = peer.run(mode, prompt.id, prompt.category, prompt_ids, max_tokens, warmup)
    if not warmup:
        n = len(run.token_ids)
        progress(f"spec: T=0.0 batch 1 {prompt.id}: llama.cpp {mode}: {n} tokens in {run.seconds:.1f} s "
                 f"({n / run.seconds:.2f} tok/s)")


def run_llamacpp_only(s: SpecSettings) -> dict[str, Any]:
    """`--llamacpp-only`: llama.cpp's modes alone over the bench's prompts (our chat template's token ids),
    interleaved per prompt as in the full run; the JSON has the full run's shape with no results of ours."""
    from cluster.engine.factory import eos_token_ids, load_tokenizer, model_dir
    from model_runtime.config import ModelConfig

    set_threads(s.threads)
    env = environment()
    target_dir = model_dir(s.model)
    tokenizer = load_tokenizer(target_dir)
    prompts = load_prompts(s.categories, s.per_category)
    prompt_ids = {p.id: tokenize_prompt(tokenizer, p.text, chat=True) for p in prompts}
    peer = llamacpp_peer(s, eos_token_ids(target_dir, ModelConfig.from_dir(target_dir), tokenizer))
    modes = peer.modes()
    progress("spec: warm-up")
    for mode in modes:
        llamacpp_run(peer, mode, prompts[0], prompt_ids[prompts[0].id], WARMUP_TOKENS, warmup=True)
    for i, prompt in enumerate(prompts):
        shift = i % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            llamacpp_run(peer, mode, prompt, prompt_ids[prompt.id], s.max_tokens)
    report = peer.report()
    peer.close()
    env["loadavg_at_end"] = list(os.getloadavg())
    settings = dataclasses.asdict(s)
    settings["ks"] = ["auto" if k is None else k for k in s.ks]
    return {"bench": "spec", "settings": settings,
            "prompts": [{"id": p.id, "category": p.category, "prompt_tokens": len(prompt_ids[p.id])} for p in prompts],
            "results": [], "hf": [], "llamacpp": report, "environment": env}
