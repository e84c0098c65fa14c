"""`bench spec`'s settings (the command line's flags as one value) and `--quick`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.bench.bench_prompts import CATEGORIES
from specserve_types.api import EXACT_RULES


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
    hf_dtype: str = "bfloat16"  # transformers' weights, as a CPU user loads these models (bench/spec.py); or "auto"
    max_context: int = 1024
    dtype: str = "auto"  # the target's: see model_runtime.precision.target_dtype
    draft_dtype: str = "auto"  # see model_runtime.precision.draft_dtype
    tracing_overhead: bool = False  # also run every config traced (every span sampled, exported to a file)
    logprobs_overhead: int | None = None  # also run every config with `logprobs` N (log-probabilities' cost)
    llamacpp: bool = False  # also llama.cpp on the same GGUF files, greedy (cluster/bench/llamacpp.py)
    llamacpp_only: bool = False  # llama.cpp alone: neither our engine nor transformers
    llamacpp_draft_tokens: int = 4  # tokens llama.cpp's draft model proposes per round
    llamacpp_bin: str | None = None  # native llama.cpp binaries (default: scripts/build-llamacpp.sh's folder)
    llamacpp_python: bool = False  # llama-cpp-python's Python loop instead (not how llama.cpp's users run it)
    repeats: int = 1  # batch > 1: runs of every config, in rotating order (figures over all runs)
    tree_nodes: list[int] = field(default_factory=lambda: [16])  # "suffix", "model" configs: 0 = chains, N = trees
    # "model" configs at k auto: the chain stop thresholds (EngineConfig.draft_stop_below) to run side by side; None:
    # the engine's default alone
    draft_stop_below: list[float] | None = None
    # "model" configs at k auto: the engine's draft_lookup values to run side by side; None: its default alone
    draft_lookup: list[bool] | None = None
    # temperature > 0: the engine's exact_rule values (EXACT_RULES) to run side by side; None: its default alone
    exact_rule: list[str] | None = None

    def __post_init__(self) -> None:
        if self.draft == "none" and "model" in self.drafts:
            raise ValueError("draft kind 'model' needs a draft model (--draft)")
        assert set(self.drafts) <= {"model", "ngram", "suffix"}, self.drafts
        assert self.tree_nodes and all(0 <= n <= 64 for n in self.tree_nodes), self.tree_nodes
        assert self.draft_stop_below is None or (self.draft_stop_below and all(
            0.0 <= x <= 1.0 for x in self.draft_stop_below)), self.draft_stop_below
        assert self.draft_lookup is None or (self.draft_lookup and len(set(self.draft_lookup)) == len(
            self.draft_lookup)), self.draft_lookup
        assert self.exact_rule is None or (self.exact_rule and set(self.exact_rule) <= set(EXACT_RULES) and len(
            set(self.exact_rule)) == len(self.exact_rule)), self.exact_rule
        assert self.ks and all(k is None or 1 <= k <= 8 for k in self.ks), self.ks
        assert all(b >= 1 for b in self.batches) and self.max_tokens >= 1 and self.per_category >= 1
        assert self.repeats >= 1, self.repeats


QUICK = dict(model="smollm2-135m", draft="none", drafts=["ngram"], categories=["code", "qa", "copy-edit"],
             per_category=1, ks=[2, None], temperatures=[0.0], batches=[1], max_tokens=16)
