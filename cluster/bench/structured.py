"""`specserve bench structured`: constrained decoding (JSON schemas) with and without speculation, and native
llama.cpp's `llama-server` on the same GGUF files with the same schemas (`json_schema`), in one run.

Glossary (figures in the JSON; docs/speed.md "Structured output"):
  case            a chat prompt and the JSON schema its output must match (cluster/bench/prompts/structured.jsonl:
                  five shapes: a flat object, nested objects, an array of objects, enums and bounded numbers, a
                  code signature)
  config          plain (draft "none": constrained plain decoding), or a drafter ("model", "ngram", "suffix") at k
                  auto; "model-free": the draft model drafting without the constraint (`constrain_drafts: false`,
                  the engine cutting what it forbids); each at every temperature (0: greedy contract, else exact,
                  unseeded as most clients send it, so auto reads the measured costs; `--seeded`: seed + case index,
                  whose k reads nominal costs only: docs/api.md "Seeds")
  tokens/s        output tokens / wall seconds of the request, prefill included (llama-server's the same, timed
                  around its HTTP call)
  vs_plain        tokens/s over our constrained plain decoding at the same temperature (sums over the cases)
  forced          drafts the constraint forced (no drafter ran for them) and their share of the emitted tokens
  cut             drafts the constraint forbade (cut before the verify)
  constraint cost per output token, over plain decoding's seconds per token (the constraint's own cost per decode
                  step): the requests' matcher time (masks, forced tokens, advancing: `constraint_seconds`) plus the
                  verifier's masking, each verified row priced at a full mask's application (`mask_ms_per_row`,
                  timed on the model's vocabulary with the case's first mask: an upper bound, as a greedy row whose
                  argmax is allowed costs one bit test)
  valid           outputs that parse as JSON and validate against their schema (jsonschema); `length` where a
                  case ran out of max_tokens before its object closed
  same_as_plain   greedy: outputs equal to our constrained plain decoding's, token by token

Order: each case runs through every config and llama-server mode before the next case, rotating the order, so
load from other processes falls on all alike; a fresh engine per run (no prefix cache across runs) shares the
loaded workers and carries the auto policy's state per config, as a long-running server would.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from cluster.bench.runtime import environment, progress, set_threads
from cluster.engine.engine import SpecEngine
from cluster.engine.factory import fresh_engine, tokenize_prompt
from specserve_types.api import Constraint, GenerationRequest, SamplingParams, SpecParams

WARMUP_TOKENS = 16


@dataclass(frozen=True)
class StructuredCase:
    id: str
    shape: str
    prompt: str
    schema: dict[str, Any]


def load_cases(ids: list[str] | None = None) -> list[StructuredCase]:
    text = resources.files("cluster.bench").joinpath("prompts/structured.jsonl").read_text()
    cases = [StructuredCase(**json.loads(line)) for line in text.splitlines() if line.strip()]
    if ids:
        unknown = set(ids) - {c.id for c in cases}
        if unknown:
            raise ValueError(f"unknown cases {sorted(unknown)}; known: {[c.id for c in cases]}")
        cases = [c for c in cases if c.id in ids]
    return cases


@dataclass(frozen=True)
class StructuredSettings:
    model: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"  # the draft model ("none": n-gram and suffix drafters only)
    drafts: tuple[str, ...] = ("model",)  # speculative configs beside plain decoding
    temperatures: tuple[float, ...] = (0.0, 0.7)
    cases: tuple[str, ...] = ()  # () = all five
    max_tokens: int = 160
    repeats: int = 1
    seed: int = 7
    threads: int = 2
    dtype: str = "auto"
    draft_dtype: str = "auto"
    llamacpp: bool = False  # native llama-server, plain and with the draft model, on the same GGUF files
    llamacpp_bin: str | None = None
    llamacpp_draft_tokens: int = 8
    seeded: bool = False  # sampled requests carry seed + case index


@dataclass
class Run:
    case: str
    config: str
    temperature: float
    tokens: list[int]
    seconds: float
    text: str
    finish: str
    stats: dict[str, Any] = field(default_factory=dict)


class StructuredBench:
    """Owner of the loaded workers, the llama-server processes and every run of one benchmark."""

    def __init__(self, s: StructuredSettings) -> None:
        from cluster.engine.factory import build_local_engine
        from cluster.serving.config import NGRAM_DRAFT, make_config

        self.s = s
        settings = make_config(model=s.model, draft=NGRAM_DRAFT if s.draft == "none" else s.draft, max_batch=1,
                               kv_blocks=None, dtype=s.dtype, draft_dtype=s.draft_dtype, warm_up=True)
        progress(f"structured: loading {s.model} (draft {s.draft})")
        self.base = build_local_engine(s.model, s.draft, settings.engine_config(), settings.local_runtime())
        progress("structured: " + ", ".join(f"{role} {dtype}" for role, dtype in self.base.dtypes.items()))
        self.cases = load_cases(list(s.cases) or None)
        self.prompt_ids = {c.id: tokenize_prompt(self.base.tokenizer, c.prompt, chat=True) for c in self.cases}
        self.configs = ["plain", *s.drafts]
        self.policy: dict[tuple[str, float], tuple[Any, Any, Any]] = {}
        self.runs: list[Run] = []
        self.llama = LlamaServers(s, self.base.eos_token_ids) if s.llamacpp else None

    def _engine(self, config: str, temperature: float) -> SpecEngine:
        base = self.base
        cost, acceptance, lookup = self.policy.get((config, temperature), (copy.deepcopy(base.cost), None, None))
        return fresh_engine(base, dataclasses.replace(base.config, constrain_drafts=config != "model-free"),
                            cost=cost, acceptance=acceptance, lookup_acceptance=lookup)

    def run_ours(self, config: str, temperature: float, case: StructuredCase, index: int, warmup: bool = False) -> None:
        engine = self._engine(config, temperature)
        draft = {"plain": "none", "model-free": "model"}.get(config, config)
        greedy = temperature == 0
        request = GenerationRequest(
            case.id, tuple(self.prompt_ids[case.id]),
            SamplingParams(temperature=temperature, max_tokens=WARMUP_TOKENS if warmup else self.s.max_tokens,
                           seed=self.s.seed + index if self.s.seeded and not greedy else None),
            SpecParams(contract="greedy" if greedy else "exact", k=0 if draft == "none" else None, draft=draft),
            constraint=Constraint("json", json.dumps(case.schema), field="response_format"))
        start = time.perf_counter()
        engine.submit(request)
        chunks = engine.run_to_completion()[case.id]
        seconds = time.perf_counter() - start
        engine.kv.audit().assert_no_leaks()
        engine.check_ledger()
        if warmup:
            return
        self.policy[(config, temperature)] = (engine.cost, engine.acceptance, engine.lookup_acceptance)
        tokens = [t for c in chunks for t in c.token_ids]
        stats = dict(chunks[-1].stats or {})
        stats["cut"] = engine.stats()["constraint_cut"]
        run = Run(case.id, config, temperature, tokens, seconds, "".join(c.text_delta for c in chunks),
                  chunks[-1].finish_reason or "", stats)
        self.runs.append(run)
        progress(f"structured: T={temperature} {case.id}: {config}: {len(tokens)} tokens in {seconds:.1f} s "
                 f"({len(tokens) / seconds:.2f} tok/s, {run.finish})")

    def run_llama(self, mode: str, temperature: float, case: StructuredCase, index: int, warmup: bool = False) -> None:
        assert self.llama is not None
        tokens, text, seconds, timings = self.llama.complete(
            mode, self.prompt_ids[case.id], case.schema, WARMUP_TOKENS if warmup else self.s.max_tokens,
            temperature, self.s.seed + index)
        if warmup:
            return
        self.runs.append(Run(case.id, f"llama.cpp {mode}", temperature, tokens, seconds, text, "", timings))
        progress(f"structured: T={temperature} {case.id}: llama.cpp {mode}: {len(tokens)} tokens in {seconds:.1f} s "
                 f"({len(tokens) / seconds:.2f} tok/s)")

    def jobs(self, temperature: float) -> list[tuple[str, Any]]:
        ours = [(c, self.run_ours) for c in self.configs]
        theirs = [(m, self.run_llama) for m in (self.llama.modes if self.llama else [])]
        return ours + theirs

    def run(self) -> dict[str, Any]:
        for temperature in self.s.temperatures:
            jobs = self.jobs(temperature)
            for name, job in jobs:  # warm-up: each config once, untimed
                job(name, temperature, self.cases[0], 0, warmup=True)
            for repeat in range(self.s.repeats):
                for index, case in enumerate(self.cases):
                    shift = (index + repeat) % len(jobs)
                    for name, job in jobs[shift:] + jobs[:shift]:
                        job(name, temperature, case, index)
        return self.report()

    def mask_ms_per_row(self) -> float:
        """The verifier's cost of one row's full mask (sampling.apply_allowed) on the model's vocabulary, with each
        case's first mask (median of 30, ms)."""
        import statistics

        import torch

        from verifier_service.sampling import apply_allowed

        assert self.base.constraints is not None
        times = []
        for case in self.cases:
            mask = self.base.constraints.compile(Constraint("json", json.dumps(case.schema))).allowed_mask()[None]
            logits = torch.randn(1, self.base.vocab_size)
            for _ in range(30):
                start = time.perf_counter()
                apply_allowed(logits, mask)
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    def report(self) -> dict[str, Any]:
        import jsonschema

        schemas = {c.id: c.schema for c in self.cases}
        mask_ms = self.mask_ms_per_row()
        rows = []
        for temperature in self.s.temperatures:
            names = self.configs + [f"llama.cpp {m}" for m in (self.llama.modes if self.llama else [])]
            plain = [r for r in self.runs if r.temperature == temperature and r.config == "plain"]
            plain_rate = _rate(plain)
            plain_step = sum(r.seconds for r in plain) / max(1, sum(len(r.tokens) for r in plain))
            plain_tokens = {r.case: r.tokens for r in plain}
            for name in names:
                runs = [r for r in self.runs if r.temperature == temperature and r.config == name]
                if not runs:
                    continue
                tokens = sum(len(r.tokens) for r in runs)
                valid = sum(_valid(r.text, schemas[r.case], jsonschema) for r in runs)
                row: dict[str, Any] = {
                    "temperature": temperature, "config": name, "runs": len(runs), "tokens": tokens,
                    "seconds": round(sum(r.seconds for r in runs), 3), "tokens_per_s": round(_rate(runs), 3),
                    "vs_plain": round(_rate(runs) / plain_rate, 3) if plain_rate else None,
                    "valid": valid, "finish": {f: sum(r.finish == f for r in runs) for f in {r.finish for r in runs}},
                    "by_case": {r.case: round(len(r.tokens) / r.seconds, 3) for r in runs},
                }
                if temperature == 0 and not name.startswith("llama"):
                    row["same_as_plain"] = sum(plain_tokens.get(r.case) == r.tokens for r in runs)
                if not name.startswith("llama"):
                    forced = sum(r.stats.get("forced", {}).get("proposed", 0) for r in runs)
                    forced_acc = sum(r.stats.get("forced", {}).get("accepted", 0) for r in runs)
                    acc = [r.stats.get("acceptance", {}) for r in runs]
                    proposed, accepted = sum(a.get("proposed", 0) for a in acc), sum(a.get("accepted", 0) for a in acc)
                    verified = tokens + proposed + forced  # rows verified: one a token, one a rejected draft at most
                    constraint = sum(r.stats.get("constraint_seconds", 0.0) for r in runs) + verified * mask_ms / 1e3
                    row.update({
                        "forced_proposed": forced, "forced_accepted": forced_acc,
                        "forced_share_of_tokens": round(forced_acc / tokens, 4) if tokens else 0.0,
                        "drafts_proposed": proposed, "drafts_accepted": accepted,
                        "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
                        "cut": sum(r.stats.get("cut", 0) for r in runs),
                        "constraint_ms_per_token": round(1e3 * constraint / tokens, 4) if tokens else None,
                        "constraint_cost_vs_plain_step": round(constraint / tokens / plain_step, 4)
                        if tokens and plain_step else None,
                    })
                rows.append(row)
        env = environment()
        env["loadavg_at_end"] = list(os.getloadavg())
        return {"bench": "structured", "settings": dataclasses.asdict(self.s), "dtypes": dict(self.base.dtypes),
                "environment": env, "rows": rows, "mask_ms_per_row": round(mask_ms, 4),
                "llama_cpp": self.llama.info() if self.llama else None,
                "runs": [dataclasses.asdict(r) for r in self.runs]}

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()


def _rate(runs: list[Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.tokens) for r in runs) / seconds if seconds else 0.0


def _valid(text: str, schema: dict[str, Any], jsonschema: Any) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


class LlamaServers:
    """Native llama-server on the GGUF files our models are prepared from: plain, and with the draft model
    (`-md`, draft-simple), each asked through /completion with the case's `json_schema` (llama.cpp converts it
    to a GBNF grammar)."""

    def __init__(self, s: StructuredSettings, eos_token_ids: Any) -> None:
        from cluster.bench.gguf_file import gguf_path
        from cluster.bench.llamacpp_native import _Server, build_info, require_binaries

        self.bin_dir = require_binaries(Path(s.llamacpp_bin) if s.llamacpp_bin else None)
        self.build = build_info(self.bin_dir)
        logs = Path(os.environ.get("TMPDIR", "/tmp"))
        threads = ["-t", str(s.threads), "-tb", str(s.threads)]
        common = ["-m", str(gguf_path(s.model)), "-c", "4096", *threads]
        self.servers: dict[str, Any] = {}
        try:
            self.servers["plain"] = _Server(self.bin_dir, common, logs / "llama-server-structured-plain.log")
            if s.draft != "none":
                self.servers["draft_model"] = _Server(
                    self.bin_dir, [*common, "-md", str(gguf_path(s.draft)), "-td", str(s.threads), "-tbd",
                                   str(s.threads), "--spec-type", "draft-simple", "--spec-draft-n-max",
                                   str(s.llamacpp_draft_tokens)], logs / "llama-server-structured-draft.log")
        except Exception:
            self.close()
            raise
        self.modes = list(self.servers)

    def complete(self, mode: str, prompt_ids: list[int], schema: dict[str, Any], max_tokens: int, temperature: float,
                 seed: int) -> tuple[list[int], str, float, dict[str, Any]]:
        body: dict[str, Any] = {"prompt": prompt_ids, "n_predict": max_tokens, "json_schema": schema,
                                "cache_prompt": False, "return_tokens": True, "stream": False, "repeat_penalty": 1.0}
        if temperature == 0:
            body.update({"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "samplers": ["top_k"]})
        else:
            body.update({"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": seed,
                         "samplers": ["temperature"]})
        port = self.servers[mode].port
        request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            out = json.loads(response.read())
        seconds = time.perf_counter() - start
        timings = out.get("timings", {})
        return ([int(t) for t in out.get("tokens", [])], str(out.get("content", "")), seconds,
                {"draft_n": timings.get("draft_n", 0), "draft_n_accepted": timings.get("draft_n_accepted", 0)})

    def info(self) -> dict[str, Any]:
        return {"build": self.build, "servers": {m: s.command for m, s in self.servers.items()}}

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


def run_structured_bench(s: StructuredSettings) -> dict[str, Any]:
    set_threads(s.threads)
    bench = StructuredBench(s)
    try:
        return bench.run()
    finally:
        bench.close()
