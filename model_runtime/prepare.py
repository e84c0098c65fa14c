"""Prepare a model once: assemble + verify its GGUF, convert it to a safetensors checkpoint in the cache.

Cache layout (root = $SPECSERVE_CACHE, default ~/.cache/specserve):

    root/<name>/                   complete entry: an HF checkpoint dir + manifest.json (written last)
    root/.<name>.lock              flock held while one process prepares <name>
    root/.<name>.staging-XXXX/     in progress; deleted on success, failure, and by the next prepare
        <gguf_name>                  assembled file (multi-part sources only)
        checkpoint/                  converted checkpoint, renamed to root/<name> when complete
    root/<name>/quant-v3.safetensors the GGUF's quantized linears packed for `--dtype q4` (model_runtime/
                                   quant_weights.py), written at prepare, or on the first q4 load of an older entry

Only a directory with a manifest whose source_sha256 matches the registry counts as cached.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from model_runtime.quant_formats import UnsupportedQuantError
from model_runtime.quant_weights import QUANT_FILE, convert_quant
from model_runtime.registry import KNOWN_MODELS, ModelSource, resolve_model
from model_runtime.weights_assemble import WeightIntegrityError, assemble_verified
from model_runtime.weights_convert import WeightConversionError, convert_gguf, fsync_dir

__all__ = [
    "MANIFEST_NAME",
    "WeightConversionError",
    "WeightIntegrityError",
    "cache_entry",
    "cache_root",
    "cached_path",
    "prepare_model",
    "prepare_quant",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


def cache_root() -> Path:
    configured = os.environ.get("SPECSERVE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specserve"


def cache_entry(source: ModelSource, cache_dir: Path | None = None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / source.name


def cached_path(source: ModelSource, cache_dir: Path | None = None) -> Path | None:
    """The complete cache entry of `source`, or None (absent, unfinished, or for other weights)."""
    entry = cache_entry(source, cache_dir)
    try:
        manifest = json.loads((entry / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return entry if manifest.get("source_sha256") == source.sha256 else None


def prepare_model(
    name_or_path: str | Path | ModelSource, cache_dir: Path | None = None, progress: bool = True
) -> Path:
    """The checkpoint directory for a model name, a ModelSource, or a local HF checkpoint dir.

    Idempotent: a cached entry is returned at once. Otherwise the parts are assembled and verified,
    converted in a staging dir next to the entry, and published by one rename; any failure leaves
    no entry and no staging dir behind.
    """
    source = name_or_path if isinstance(name_or_path, ModelSource) else resolve_model(str(name_or_path))
    if isinstance(source, Path):
        return source
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    if (done := cached_path(source, root)) is not None:
        return done
    entry = cache_entry(source, root)
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{source.name}.lock"):
        if (done := cached_path(source, root)) is not None:
            return done  # another process finished it while we waited
        _remove_leftovers(source, root)
        staging = Path(tempfile.mkdtemp(prefix=f".{source.name}.staging-", dir=root))
        try:
            _build_in(staging, source, progress)
            if entry.exists():
                shutil.rmtree(entry)  # stale: other weights, or no manifest
            os.rename(staging / "checkpoint", entry)
            fsync_dir(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    assert cached_path(source, root) == entry, entry
    return entry


def _build_in(staging: Path, source: ModelSource, progress: bool) -> dict[str, Any]:
    """Verify, convert into staging/checkpoint and write its manifest last; returns the manifest."""
    started = time.monotonic()
    gguf = _verified_gguf(source, staging, progress)
    checkpoint = staging / "checkpoint"
    facts = convert_gguf(gguf, checkpoint, progress)
    try:
        facts["quant_formats"] = convert_quant(gguf, checkpoint / QUANT_FILE, progress)["formats"]
    except UnsupportedQuantError as exc:  # the model runs in float32 / bfloat16 only
        facts["quant_formats"] = f"none: {exc}"
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "name": source.name,
        "upstream": source.upstream,
        "quantization": source.quantization,
        "source_sha256": source.sha256,
        "source_size_bytes": source.size_bytes,
        "source_parts": source.parts.describe(),
        **facts,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "prepare_seconds": round(time.monotonic() - started, 1),
    }
    manifest_path = checkpoint / MANIFEST_NAME
    with open(manifest_path, "x") as manifest_file:
        json.dump(manifest, manifest_file, indent=2)
        manifest_file.write("\n")
        manifest_file.flush()
        os.fsync(manifest_file.fileno())
    fsync_dir(checkpoint)
    return manifest


def prepare_quant(entry: Path, progress: bool = True) -> Path:
    """The packed quantized linears of a cached model (`--dtype q4`), made once from its GGUF (an entry prepared
    before they existed gets them now: its GGUF is assembled and verified again). UnsupportedQuantError for a
    local checkpoint (no GGUF) or a GGUF whose linears the kernels cannot take."""
    out = entry / QUANT_FILE
    if out.exists():
        return out
    try:
        source = KNOWN_MODELS[json.loads((entry / MANIFEST_NAME).read_text())["name"]]
    except (OSError, ValueError, KeyError) as exc:
        raise UnsupportedQuantError(f"{entry}: --dtype q4 runs a known model's GGUF; this checkpoint has none "
                                    f"({type(exc).__name__})") from exc
    root = entry.parent
    with exclusive_lock(root / f".{source.name}.lock"):
        if out.exists():
            return out
        staging = Path(tempfile.mkdtemp(prefix=f".{source.name}.staging-", dir=root))
        try:
            convert_quant(_verified_gguf(source, staging, progress), out, progress)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for stale in entry.glob("quant-v*.safetensors"):  # an earlier layout's packing, no longer read
            if stale.name != QUANT_FILE:
                stale.unlink(missing_ok=True)
    return out


def _verified_gguf(source: ModelSource, staging: Path, progress: bool) -> Path:
    """The source's GGUF with its size and SHA-256 checked: a whole file in place (no copy), or its parts assembled
    into `staging`."""
    parts = source.parts.paths()
    if len(parts) == 1 and parts[0].name.endswith(".gguf"):
        assemble_verified(source.name, parts, source.sha256, source.size_bytes, None, progress)
        return parts[0]
    gguf = staging / source.gguf_name
    assemble_verified(source.name, parts, source.sha256, source.size_bytes, gguf, progress)
    return gguf


def _remove_leftovers(source: ModelSource, root: Path) -> None:
    """Staging dirs of a killed earlier run (we hold the lock, so none is live)."""
    for leftover in root.glob(f".{source.name}.staging-*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive flock on `lock_path` (processes sharing a cache volume take turns)."""
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
