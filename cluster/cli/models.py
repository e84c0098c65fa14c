"""`specserve models list | prepare [NAME...] | path NAME`: show the registry, build the safetensors cache,
print a model's prepared HF folder (config, weights, tokenizer files: what third-party clients such as a
benchmark's `--tokenizer` need)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from model_runtime.precision import auto_is_q4, auto_q4_here
from model_runtime.prepare import cache_root, cached_path, prepare_model
from model_runtime.registry import KNOWN_MODELS, ModelSource, resolve_model
from specserve_types.api import SpecServeError

EXIT_ERROR = 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("models", help="list known models; prepare their weight cache")
    actions = parser.add_subparsers(dest="models_command", required=True)
    list_parser = actions.add_parser("list", help="known models and whether each is cached")
    list_parser.add_argument("--cache-dir", type=Path, default=None, help="default: $SPECSERVE_CACHE")
    prepare_parser = actions.add_parser(
        "prepare", help="assemble, verify and convert weights into the cache (all known models by default)"
    )
    prepare_parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"one of {', '.join(KNOWN_MODELS)}, or a local HF dir"
    )
    prepare_parser.add_argument("--cache-dir", type=Path, default=None, help="default: $SPECSERVE_CACHE")
    prepare_parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    path_parser = actions.add_parser(
        "path", help="print the prepared HF folder of a model (tokenizer files included), preparing it if needed"
    )
    path_parser.add_argument("name", metavar="NAME", help=f"one of {', '.join(KNOWN_MODELS)}, or a local HF dir")
    path_parser.add_argument("--cache-dir", type=Path, default=None, help="default: $SPECSERVE_CACHE")
    path_parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        if args.models_command == "list":
            print(format_table(args.cache_dir))
            return 0
        if args.models_command == "path":
            print(prepare_model(args.name, args.cache_dir, not args.no_progress))
            return 0
        return _prepare(args.names or list(KNOWN_MODELS), args.cache_dir, not args.no_progress)
    except (SpecServeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def format_table(cache_dir: Path | None) -> str:
    from model_runtime.precision import draft_dtype, dtype_name, target_dtype
    from model_runtime.quant_weights import QUANT_FILE

    header = ("NAME", "ROLE", "PARAMS", "QUANT", "RUNS AS", "--dtype q4", "CACHED")
    rows = [header]
    # what --dtype auto / --draft-dtype auto run on this machine's CPU (the weights are converted at load)
    runs_as = {"target": dtype_name(target_dtype("auto", "cpu")), "draft": dtype_name(draft_dtype("auto", "cpu"))}
    for source in KNOWN_MODELS.values():
        entry = cached_path(source, cache_dir)
        cached = str(entry) if entry is not None else "no (run: specserve models prepare " + source.name + ")"
        dtype = runs_as["draft" if source.role == "draft" else "target"]
        # auto reads the model (precision.py): a known one, prepared or not; its GGUF taken on trust here
        if auto_is_q4(entry, "cpu", prepare=False) if entry is not None else auto_q4_here():
            dtype = "q4"
        elif source.role != "draft" and (auto_is_q4(entry, "cpu", prepare=False, max_batch=1) if entry is not None
                                         else auto_q4_here(max_batch=1)):
            dtype = f"q4 alone, {dtype} batched"  # AMX: the engine's max_batch decides
        # the GGUF's own codes, packed once (model_runtime/quant_weights.py): ready, or made at the first q4 load
        q4 = "-" if entry is None else ("packed" if (entry / QUANT_FILE).exists() else "at first use")
        rows.append((source.name, source.role, source.parameters, source.quantization, dtype, q4, cached))
    widths = [max(len(row[col]) for row in rows) for col in range(len(header) - 1)]
    lines = [
        "  ".join([*(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)), row[-1]])
        for row in rows
    ]
    root = cache_dir if cache_dir is not None else cache_root()
    return "\n".join([*lines, f"cache: {root}"])


def _prepare(names: list[str], cache_dir: Path | None, progress: bool) -> int:
    targets: list[ModelSource | Path] = [resolve_model(name) for name in names]  # refuse before work
    for name, target in zip(names, targets, strict=True):
        started = time.monotonic()
        path = prepare_model(target if isinstance(target, ModelSource) else name, cache_dir, progress)
        print(f"{name}: {path} ({time.monotonic() - started:.1f}s)")
    return 0
