"""The bench commands' plain-text tables and JSON files (cluster/cli/bench.py and its reports)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def write_json(result: dict[str, Any], path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON written to {path}", file=sys.stderr)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.0f}"
