"""The GGUF file a registry model is prepared from, whole on disk, for a peer that reads GGUF (llama.cpp).

`specserve models prepare` assembles a multi-part GGUF only in its staging directory and keeps the
converted checkpoint (model_runtime/prepare.py). A peer that runs the GGUF itself needs the file: it is
assembled once more from the same parts, verified against the registry's SHA-256 and size, and kept as

    <cache root>/gguf/<gguf_name>      published by one rename after the hash matched

A single-file source (a package shipping the whole .gguf) is used in place.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from model_runtime.prepare import cache_root, exclusive_lock
from model_runtime.registry import ModelSource, resolve_model
from model_runtime.weights_assemble import assemble_verified
from specserve_types.api import SpecServeError

GGUF_DIR = "gguf"


class NoGGUFError(SpecServeError, ValueError):
    """A local checkpoint directory: no registry GGUF to read."""


def gguf_path(name: str | ModelSource, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The verified GGUF file of a registry model (name or source), assembling it on first use."""
    source = name if isinstance(name, ModelSource) else resolve_model(name)
    if not isinstance(source, ModelSource):
        raise NoGGUFError(f"{name!r} is a local checkpoint, not a registry model: no GGUF file to give llama.cpp")
    parts = source.parts.paths()
    if len(parts) == 1 and parts[0].name.endswith(".gguf"):
        return parts[0]  # the package ships the whole file (prepare verified its hash)
    root = (Path(cache_dir) if cache_dir is not None else cache_root()) / GGUF_DIR
    dest = root / source.gguf_name
    if _complete(dest, source):
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{source.gguf_name}.lock"):
        if _complete(dest, source):
            return dest
        fd, tmp_name = tempfile.mkstemp(prefix=f".{source.gguf_name}.", suffix=".partial", dir=root)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            tmp.unlink()  # assemble_verified creates its destination exclusively
            assemble_verified(source.name, parts, source.sha256, source.size_bytes, tmp, progress)
            os.rename(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def _complete(path: Path, source: ModelSource) -> bool:
    """Only a verified file is ever renamed to `path`; the size check catches a file replaced by hand."""
    return path.is_file() and path.stat().st_size == source.size_bytes
