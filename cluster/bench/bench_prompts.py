"""The bench prompt set (prompts/bench_prompts.jsonl): five categories, read by `bench spec` and `bench serve`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPTS_PATH = Path(__file__).parent / "prompts" / "bench_prompts.jsonl"
CATEGORIES = ("prose", "code", "qa", "summarisation", "copy-edit")
WARMUP_TOKENS = 4


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
