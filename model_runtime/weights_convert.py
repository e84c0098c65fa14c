"""Convert one verified GGUF file into a float32 Hugging Face checkpoint directory (safetensors)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specserve_types.api import SpecServeError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from local files only; never a hub

DTYPE = "float32"


class WeightConversionError(SpecServeError, RuntimeError):
    """transformers could not turn a (verified) GGUF file into a checkpoint."""


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Dequantize `gguf_path` with transformers and save model + tokenizer into `out_dir` (fsynced).

    Returns facts for the manifest: architecture, model_type, dtype, tie_word_embeddings, num_parameters.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    try:
        with _transformers_progress(progress):
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_dir,
                gguf_file=gguf_file,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
                local_files_only=True,
            )
    except Exception as exc:  # transformers raises many types here; report one
        raise WeightConversionError(f"transformers could not load {gguf_path.name}: {exc}") from exc

    if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
        raise WeightConversionError(f"{gguf_path.name}: model stayed quantized; cannot save as safetensors")
    if tokenizer.chat_template is None:
        raise WeightConversionError(f"{gguf_path.name}: the GGUF carries no chat template")
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if tied != bool(model.config.tie_word_embeddings):
        raise WeightConversionError(
            f"{gguf_path.name}: config.tie_word_embeddings={model.config.tie_word_embeddings} "
            f"but lm_head {'is' if tied else 'is not'} the embedding"
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _make_readable(out_dir)
    fsync_tree(out_dir)
    return {
        "architecture": type(model).__name__,
        "model_type": model.config.model_type,
        "dtype": DTYPE,
        "tie_word_embeddings": tied,
        "num_parameters": model.num_parameters(),
    }


def _make_readable(root: Path) -> None:
    """save_pretrained writes model.safetensors 0600; the cache is read by every local process."""
    for path in root.iterdir():
        if path.is_file():
            path.chmod(0o644)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then the directories, so a later rename publishes durable data."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            fsync_path(Path(dirpath) / filename)
        fsync_path(Path(dirpath))


def fsync_path(path: Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path  # a directory's entries (a rename into it) are durable after this


@contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()
