"""llama.cpp beside our engine in `specserve bench spec --llamacpp` (optional: llama-cpp-python).

llama.cpp runs the very GGUF files our models are prepared from (cluster/bench/gguf_file.py), on the same
prompt token ids (our chat template), greedy, one prompt at a time, with the bench's thread count:

  plain           the target alone
  draft_model     llama-cpp-python's speculative loop (Llama(draft_model=...)) with the draft GGUF in a
                  second Llama proposing `draft_tokens` greedy tokens per round (cluster/bench/llamacpp_draft.py)
  prompt_lookup   the same loop with its LlamaPromptLookupDecoding (n-gram lookup, max_ngram_size 2)

Figures (JSON `llamacpp`): tokens/s = output tokens / wall seconds, prefill included, as ours; ratio to its
own plain decoding, overall and per category; `spec_text_equals_plain` per prompt (greedy speculative text
== greedy plain text, llama.cpp's own detokenizer); `tokens_per_round` = output tokens / draft calls.
A stop is EOS (kept, as our engine counts it) or `max_tokens`.

llama_cpp is imported only by `LlamaCppPeer` (and llamacpp_draft.py); everything else here is plain data.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specserve_types.api import SpecServeError

PIN = "llama-cpp-python==0.3.36"
INSTALL_HINT = (
    f"llama-cpp-python is optional and not installed: `.venv/bin/pip install -e '.[llamacpp]'` ({PIN}; pip "
    "compiles llama.cpp from source: it needs cmake and a C++ compiler; docs/speed.md gives the CMAKE_ARGS "
    "for x86 CPUs whose AMX kernels fail). Native llama.cpp, as its users run it: scripts/build-llamacpp.sh")
MODES = ("plain", "draft_model", "prompt_lookup")
PLAIN = "plain"


class LlamaCppMissingError(SpecServeError, ImportError):
    """`--llamacpp` without llama-cpp-python importable."""


def require_llama_cpp() -> Any:
    """The llama_cpp module, or LlamaCppMissingError saying how to install it."""
    try:
        import llama_cpp
    except (ImportError, OSError) as exc:  # OSError: the package is there but its shared library is not
        raise LlamaCppMissingError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from exc
    return llama_cpp


@dataclass(frozen=True)
class LlamaCppJob:
    """One llama.cpp mode as a job of the bench's interleaved batch-1 schedule."""

    mode: str


@dataclass(frozen=True)
class LlamaCppRun:
    prompt_id: str
    category: str
    mode: str
    token_ids: tuple[int, ...]
    text: str
    seconds: float
    draft_calls: int = 0  # rounds of the speculative loop (0 for plain)
    drafted_tokens: int = 0


# ---------------------------------------------------------------------- pure aggregation
def summarise(runs: list[LlamaCppRun], our_plain: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Per mode: totals and per category tok/s, ratio to llama.cpp plain; per prompt: spec text == plain text.

    `our_plain`: our engine's greedy plain outputs by prompt id (batch 1), if that ran.
    """
    by_mode: dict[str, dict[str, LlamaCppRun]] = {}
    for run in runs:
        by_mode.setdefault(run.mode, {})[run.prompt_id] = run
    plain = by_mode.get(PLAIN, {})
    modes = []
    for mode in [m for m in MODES if m in by_mode]:
        mode_runs = list(by_mode[mode].values())
        row: dict[str, Any] = {"mode": mode, **_totals(mode_runs), "by_category": {}}
        for category in dict.fromkeys(r.category for r in mode_runs):
            row["by_category"][category] = _totals([r for r in mode_runs if r.category == category])
        plain_row = _totals(list(plain.values())) if plain else None
        row["speedup_vs_plain"] = _ratio(row, plain_row)
        row["by_category_speedup_vs_plain"] = {
            c: _ratio(cell, _totals([r for r in plain.values() if r.category == c])) for c, cell in row["by_category"].items()
        } if plain else {}
        calls = sum(r.draft_calls for r in mode_runs)
        if calls:
            row["draft_calls"] = calls
            row["drafted_tokens"] = sum(r.drafted_tokens for r in mode_runs)
            row["tokens_per_round"] = row["output_tokens"] / calls
        if mode != PLAIN and plain:
            equal = text_equality(by_mode[mode], plain)
            row["spec_text_equals_plain"] = equal
            row["same_text_fraction"] = sum(equal.values()) / len(equal) if equal else None
        if mode == PLAIN and our_plain:
            common = [pid for pid in by_mode[mode] if pid in our_plain]
            row["same_tokens_as_our_plain"] = (sum(list(by_mode[mode][pid].token_ids) == our_plain[pid]
                                                   for pid in common) / len(common)) if common else None
        modes.append(row)
    prompts = [{"id": pid, "category": run.category, "plain_output_tokens": len(run.token_ids),
                "spec_text_equals_plain": {m: by_mode[m][pid].text == run.text for m in MODES
                                           if m != PLAIN and pid in by_mode.get(m, {})}}
               for pid, run in plain.items()]
    return {"modes": modes, "prompts": prompts}


def text_equality(spec: dict[str, LlamaCppRun], plain: dict[str, LlamaCppRun]) -> dict[str, bool]:
    """prompt id -> the speculative text equals the plain text, for the prompts both ran."""
    return {pid: run.text == plain[pid].text for pid, run in spec.items() if pid in plain}


def _totals(runs: list[LlamaCppRun]) -> dict[str, Any]:
    tokens = sum(len(r.token_ids) for r in runs)
    seconds = sum(r.seconds for r in runs)
    return {"output_tokens": tokens, "wall_seconds": seconds, "tokens_per_second": tokens / seconds if seconds else 0.0}


def _ratio(a: dict[str, Any], b: dict[str, Any] | None) -> float | None:
    if b is None or not (a["tokens_per_second"] and b["tokens_per_second"]):
        return None
    return a["tokens_per_second"] / b["tokens_per_second"]


def tables(section: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """The printed view of a `summarise` section: (title, headers, rows) per table."""
    s = section["settings"]
    modes = {m["mode"]: m for m in section["modes"]}
    spec_modes = [m for m in MODES if m != PLAIN and m in modes]
    title = (f"\nllama.cpp {section['version']}, on {s.get('cpu') or 'this CPU'}, on the same GGUF files ({Path(s['model_gguf']).name}, draft "
             f"{Path(s['draft_gguf']).name if s['draft_gguf'] else 'none'}), greedy, batch 1, {s['threads']} threads"
             + (f", draft_model k={s['draft_tokens']}" if "draft_model" in modes else "")
             + (f", prompt_lookup {s['lookup_tokens']} tokens" if "prompt_lookup" in modes else "") + ":")
    headers = ["category", "plain tok/s"] + [h for m in spec_modes for h in (f"{m} tok/s", "x plain")]
    categories = list(modes[PLAIN]["by_category"]) if PLAIN in modes else []
    rows = []
    for category in [*categories, "all"]:
        plain = _cell(modes, PLAIN, category)
        row: list[Any] = [category, plain["tokens_per_second"] if plain else None]
        for m in spec_modes:
            cell = _cell(modes, m, category)
            row += [cell["tokens_per_second"] if cell else None, modes[m]["speedup_vs_plain"] if category == "all"
                    else modes[m]["by_category_speedup_vs_plain"].get(category)]
        rows.append(row)
    out = [(title, headers, rows)]
    if section["prompts"] and spec_modes:
        out.append(("\nllama.cpp: greedy speculative text == plain text, per prompt:",
                    ["prompt", "category", "plain tokens", *[f"{m} =plain" for m in spec_modes]],
                    [[p["id"], p["category"], p["plain_output_tokens"],
                      *[p["spec_text_equals_plain"].get(m) for m in spec_modes]] for p in section["prompts"]]))
    return out


def _cell(modes: dict[str, dict[str, Any]], mode: str, category: str) -> dict[str, Any] | None:
    if mode not in modes:
        return None
    return modes[mode] if category == "all" else modes[mode]["by_category"].get(category)


# ---------------------------------------------------------------------- the llama.cpp side
@dataclass
class LlamaCppSettings:
    model_gguf: Path
    draft_gguf: Path | None  # None: no draft_model mode
    threads: int
    n_ctx: int
    draft_tokens: int  # tokens the draft model proposes per round
    lookup_tokens: int  # LlamaPromptLookupDecoding's num_pred_tokens
    lookup: bool  # measure prompt_lookup
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


class LlamaCppPeer:
    """The loaded llama.cpp models and every run of one bench."""

    def __init__(self, s: LlamaCppSettings) -> None:
        llama_cpp = require_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from cluster.bench.llamacpp_draft import CountingDraft, GreedyDraftModel

        self.s = s
        self.version = llama_cpp.__version__
        options = dict(n_ctx=s.n_ctx, n_threads=s.threads, n_threads_batch=s.threads, verbose=False)
        self.plain = llama_cpp.Llama(str(s.model_gguf), **options)
        self.drafts: dict[str, CountingDraft] = {}
        if s.draft_gguf is not None:
            self.draft_llm = llama_cpp.Llama(str(s.draft_gguf), **options)
            self.drafts["draft_model"] = CountingDraft(GreedyDraftModel(self.draft_llm, s.draft_tokens))
        if s.lookup:
            self.drafts["prompt_lookup"] = CountingDraft(LlamaPromptLookupDecoding(num_pred_tokens=s.lookup_tokens))
        # One speculative target (its logits for every position kept, as llama-cpp-python requires for a
        # draft); each run sets the mode's draft on it.
        self.spec = llama_cpp.Llama(str(s.model_gguf), draft_model=next(iter(self.drafts.values())), **options) \
            if self.drafts else None
        self.runs: list[LlamaCppRun] = []

    def modes(self) -> list[str]:
        return [m for m in MODES if m == PLAIN or m in self.drafts]

    def run(self, mode: str, prompt_id: str, category: str, prompt_ids: list[int], max_tokens: int,
            warmup: bool = False) -> LlamaCppRun:
        """One greedy generation from an empty KV cache (no prefix reuse across runs); recorded unless warm-up."""
        draft = self.drafts.get(mode)
        llm = self.plain if draft is None else self.spec
        assert llm is not None and (draft is not None or mode == PLAIN), mode
        llm.reset()
        if draft is not None:
            llm.draft_model = draft
            draft.reset()
        start = time.perf_counter()
        out = greedy_generate(llm, prompt_ids, max_tokens, self.s.eos_token_ids)
        seconds = time.perf_counter() - start
        text = llm.detokenize(out).decode("utf-8", errors="replace")
        run = LlamaCppRun(prompt_id, category, mode, tuple(out), text, seconds,
                          draft.calls if draft else 0, draft.proposed if draft else 0)
        if not warmup:
            self.runs.append(run)
        return run

    def report(self, our_plain: dict[str, list[int]] | None = None) -> dict[str, Any]:
        settings = {"model_gguf": str(self.s.model_gguf),
                    "draft_gguf": str(self.s.draft_gguf) if self.s.draft_gguf else None,
                    "threads": self.s.threads, "n_ctx": self.s.n_ctx, "draft_tokens": self.s.draft_tokens,
                    "lookup_tokens": self.s.lookup_tokens, "lookup_max_ngram_size": 2,
                    "sampling": "greedy (temp 0, top_k 1, repeat_penalty 1)", "batch": 1,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
        return {"version": self.version, "settings": settings, **summarise(self.runs, our_plain)}


def greedy_generate(llm: Any, prompt_ids: list[int], max_tokens: int, eos: frozenset[int]) -> list[int]:
    """Greedy tokens from llama-cpp-python's generate loop (speculative when the Llama has a draft model)."""
    out: list[int] = []
    tokens = llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
    try:
        for token in tokens:
            out.append(int(token))
            if token in eos or len(out) >= max_tokens:
                break
    finally:
        tokens.close()
    return out
