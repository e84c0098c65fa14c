"""Which precision the models run in: `--dtype` (the target) and `--draft-dtype` (the draft).

    auto (target): bfloat16 on CUDA and wherever our CPU kernels run (model_runtime/cpu_kernels.py: AMX, AVX-512 or
                   AVX2; batch-invariant, so greedy speculation is exact) or the CPU has bf16 instructions; else
                   float32 (SPECSERVE_CPU_KERNEL=torch on a CPU without them)
    auto (draft):  int8 on CPUs with AMX (the kernel of model_runtime/amx_kernel.py), bfloat16 on CUDA and where
                   the target's auto is bfloat16, float16 on the rest

Why: decoding streams every weight once per step, so its speed is memory bandwidth over bytes per weight.
Measured on this project's CPU (2 cores, avx512_bf16 + AMX, torch 2.13), one Qwen2.5-1.5B MLP weight
[8960 x 1536]: bf16 F.linear 0.87 ms for 1 row, 0.95 ms for 8; fp32 2.6 ms for 1 row, 4.3-4.5 ms for 8 (on a
slower day: oneDNN bf16 1.5-2.1 ms, our AMX kernel 1.0 ms for 1..16 rows, model_runtime/amx_kernel.py). On a
CPU without bf16 instructions bf16 products are emulated and slower than fp32, hence the float32 fallback.
An int8 draft (W8A8 on AMX tiles) streams half a bf16 draft's bytes: its 0.5B step measured 50 against 68 ms
inside `bench spec`, with the same survival per draft position (k=3: 0.78/0.64/0.51 against 0.77/0.63/0.51;
docs/benchmarks.md), so it is the draft's default where the kernel runs. Where the kernel then fails to
build or load, the draft runs bfloat16 and says so (model_runtime/model.py).
The weights are converted once at load (model_runtime/weights.py). Greedy outputs are exact per dtype (equal
to plain greedy decoding of the same dtype); fp32 and bf16 outputs differ from each other (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch

# int8 (drafts only): int8 linears on the AMX kernel, bfloat16 around them (model_runtime/model.py)
# q4: the GGUF's own quantized linears (model_runtime/quant_weights.py), float32 around them; torch has no dtype
# for it, so torch.quint4x2 stands for it between the option and the model's loader
Q4 = torch.quint4x2
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "q4": Q4}
TARGET_DTYPES = ("auto", "float32", "bfloat16", "q4")
DRAFT_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "q4")


@functools.cache
def cpu_has_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 products run natively (oneDNN), at twice fp32's bytes per second."""
    cpu = getattr(torch, "cpu", None)
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())  # type: ignore[union-attr]
    except AttributeError:  # an older torch: read the flags
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                flags = f.read()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_runs_amx() -> bool:
    """The AMX kernels may run here: the CPU has AMX and SPECSERVE_CPU_KERNEL does not turn them off (whether
    they build is known only when a model loads; without the kernel an int8 draft runs bfloat16)."""
    from model_runtime.amx_kernel import cpu_has_amx, turned_off

    return cpu_has_amx() and not turned_off()


def cpu_runs_own_kernels() -> bool:
    """The forward runs our batch-invariant kernels here (model_runtime/cpu_kernels.py: amx, avx512 or avx2), which
    take bf16 on any of them (widened to float32 where the CPU has no bf16 instructions: half fp32's bytes)."""
    from model_runtime.cpu_kernels import active

    return active() != "torch"


def _named(name: str, allowed: tuple[str, ...]) -> torch.dtype:
    if name not in allowed or name == "auto":
        raise ValueError(f"unknown dtype {name!r}; choose {', '.join(allowed)}")
    return DTYPES[name]


def target_dtype(name: str, device: str) -> torch.dtype:
    """The target model's precision (`--dtype`)."""
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") or cpu_runs_own_kernels() or cpu_has_bf16() \
            else torch.float32
    return _named(name, TARGET_DTYPES)


def draft_dtype(name: str, device: str) -> torch.dtype:
    """The draft model's precision (`--draft-dtype`). It changes only how often drafts are accepted, never the
    output: every contract verifies against the target's own distribution."""
    if name == "auto":
        if str(device).startswith("cuda"):
            return torch.bfloat16
        if cpu_runs_amx():
            return torch.int8
        return torch.bfloat16 if cpu_runs_own_kernels() or cpu_has_bf16() else torch.float16
    return _named(name, DRAFT_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    return "q4" if dtype == Q4 else str(dtype).removeprefix("torch.")
