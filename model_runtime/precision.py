"""Which precision the models run in: `--dtype` (the target) and `--draft-dtype` (the draft).

    auto (target): q4 (the GGUF's own 4-bit codes, model_runtime/quant_weights.py) for a known model whose GGUF
                   the quantized kernels take, on one rank, where no path packs bf16 weights at load (the kernel
                   registry's `packed_linear`), and where one does for an engine that decodes one request at a time
                   (max_batch 1); else bfloat16 on CUDA and wherever our CPU kernels run (model_runtime/cpu_kernels.py:
                   batch-invariant, so greedy speculation is exact) or the CPU has bf16 instructions; else float32
                   (SPECSERVE_CPU_KERNEL=torch on a CPU without them)
    auto (draft):  int8 where a path packs int8 weights (the registry's `int8_linear`); q4 where the target's would
                   be; bfloat16 on CUDA and where the target's auto is bfloat16, float16 on the rest

Why: decoding streams every weight once per step, so its speed is memory bandwidth over bytes per weight, and a
path's row costs decide between q4 and bf16: without packed bf16 weights q4 is the fastest exact path at every
row count; with them bf16 rows are nearly free and q4's are not, while q4 decodes one row faster; an int8 draft
streams half a bf16 draft's bytes with the same survival per draft position. The measurements, per CPU and
date: docs/precision.md ("Precision"), docs/forward.md; a draft's precision changes only how often its tokens are
accepted, never the output. Where a packed kernel then fails to build or load, the draft runs bfloat16 and says
so (model_runtime/model.py). The weights are converted once at load (model_runtime/weights.py). Greedy outputs
are exact per dtype (equal to plain greedy decoding of the same dtype); fp32 and bf16 outputs differ from each
other (docs/forward.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# int8 (drafts only): int8 linears on the registry's packed kernel, bfloat16 around them (model_runtime/model.py)
# q4: the GGUF's own quantized linears (model_runtime/quant_weights.py), float32 around them; torch has no dtype
# for it, so torch.quint4x2 stands for it between the option and the model's loader
Q4 = torch.quint4x2
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "q4": Q4}
TARGET_DTYPES = ("auto", "float32", "bfloat16", "q4")
DRAFT_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "q4")


def cpu_has_bf16() -> bool:
    """bf16 products run natively here (the libraries'), at twice fp32's bytes per second: the registry's reading of
    this CPU's flags (kernel_build.cpu_flags, SPECSERVE_CPU_FLAGS_OFF honoured)."""
    from model_runtime.kernel_registry import native_bf16

    return native_bf16()


def cpu_packs_bf16() -> bool:
    """A path that packs bf16 weights at load may run here (the registry's `packed_linear`: the CPU has it and
    SPECSERVE_CPU_KERNEL does not turn it off); whether it builds is known only when a model loads."""
    from model_runtime.kernel_registry import PACKED_LINEAR, may_run

    return may_run(PACKED_LINEAR)


def cpu_packs_int8() -> bool:
    """A path that packs int8 weights may run here (the registry's `int8_linear`; without it an int8 draft runs
    bfloat16)."""
    from model_runtime.kernel_registry import INT8_LINEAR, may_run

    return may_run(INT8_LINEAR)


def cpu_runs_own_kernels() -> bool:
    """The forward runs our batch-invariant kernels here (model_runtime/cpu_kernels.py: every registry path but
    torch's), which take bf16 on any of them (widened to float32 where the CPU has no bf16 instructions)."""
    from model_runtime.cpu_kernels import for_dtype

    return for_dtype(torch.bfloat16).exact


def why_not_q4(checkpoint: str | Path | None, device: str, tp_size: int = 1, prepare: bool = True) -> str | None:
    """None where `--dtype q4` runs `checkpoint` here; else why not, in words. `prepare`: pack the GGUF's codes
    now if they are not yet (model_runtime/prepare.py; once per model), so a GGUF the kernels cannot take says so;
    without it, a known model's cache entry is taken on trust (`models list`)."""
    from model_runtime import quant_kernels
    from model_runtime.prepare import MANIFEST_NAME, prepare_quant
    from model_runtime.quant_formats import UnsupportedQuantError
    from model_runtime.registry import KNOWN_MODELS

    if not str(device).startswith("cpu"):
        return f"q4 runs on the CPU, not {device}"
    if tp_size != 1:
        return f"q4 runs on one rank (tensor parallel size {tp_size})"
    if quant_kernels.active() is None:
        return quant_kernels.describe()
    if checkpoint is None:
        return "no model named"
    try:
        manifest = json.loads((Path(checkpoint) / MANIFEST_NAME).read_text())
        name = manifest["name"]
    except (OSError, ValueError, KeyError, TypeError):
        name = manifest = None
    if name not in KNOWN_MODELS:
        return f"{checkpoint}: a local checkpoint, no GGUF"
    formats = manifest.get("quant_formats") if isinstance(manifest, dict) else None
    if isinstance(formats, str) and formats.startswith("none"):  # prepare found the kernels cannot take its GGUF
        return formats
    if prepare:
        try:
            prepare_quant(Path(checkpoint))  # an entry prepared before the q4 codes existed (progress on stderr)
        except UnsupportedQuantError as exc:
            return str(exc)
    return None


def auto_q4_here(max_batch: int | None = None) -> bool:
    """auto runs a known model's GGUF codes on this CPU (one rank) for an engine of `max_batch`: a quantized kernel
    runs, and no path packs bf16 weights here or the engine decodes one request at a time."""
    from model_runtime import quant_kernels

    return (not cpu_packs_bf16() or max_batch == 1) and quant_kernels.active() is not None


def auto_is_q4(checkpoint: str | Path | None, device: str, tp_size: int = 1, prepare: bool = True,
               max_batch: int | None = None) -> bool:
    """auto picks q4 for this model: no path packs bf16 weights here, or one does and the engine decodes one request
    at a time (`max_batch` 1; None: not known, a batching engine) (module docstring), and q4 runs it (`why_not_q4`)."""
    return checkpoint is not None and (not cpu_packs_bf16() or max_batch == 1) and \
        why_not_q4(checkpoint, device, tp_size, prepare) is None


def _named(name: str, allowed: tuple[str, ...]) -> torch.dtype:
    if name not in allowed or name == "auto":
        raise ValueError(f"unknown dtype {name!r}; choose {', '.join(allowed)}")
    return DTYPES[name]


def target_dtype(name: str, device: str, checkpoint: str | Path | None = None, tp_size: int = 1,
                 max_batch: int | None = None) -> torch.dtype:
    """The target model's precision (`--dtype`); auto reads the model (`checkpoint`, its cache entry), the ranks
    it runs on and the engine's `max_batch` (None: not known; q4: module docstring)."""
    if name == "auto":
        if auto_is_q4(checkpoint, device, tp_size, max_batch=max_batch):
            return Q4
        return torch.bfloat16 if str(device).startswith("cuda") or cpu_runs_own_kernels() or cpu_has_bf16() \
            else torch.float32
    return _named(name, TARGET_DTYPES)


def draft_dtype(name: str, device: str, checkpoint: str | Path | None = None) -> torch.dtype:
    """The draft model's precision (`--draft-dtype`). It changes only how often drafts are accepted, never the
    output: every contract verifies against the target's own distribution."""
    if name == "auto":
        if str(device).startswith("cuda"):
            return torch.bfloat16
        if cpu_packs_int8():
            return torch.int8
        if auto_is_q4(checkpoint, device):
            return Q4
        return torch.bfloat16 if cpu_runs_own_kernels() or cpu_has_bf16() else torch.float16
    return _named(name, DRAFT_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    return "q4" if dtype == Q4 else str(dtype).removeprefix("torch.")
