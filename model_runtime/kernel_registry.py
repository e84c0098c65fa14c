"""The CPU kernels' one registry: every path a forward can take, what each builds and the ops it provides.

A forward's rows must get the same bits whatever else shares the call (greedy speculative output equals plain
decoding only then); the libraries do not promise that, so every CPU runs our own kernels, one path per kind of
CPU (docs/precision.md says why, docs/exactness.md which CPUs and tests). PATHS below is the whole table, fastest
first; each path falls back to the one below it for the ops it does not provide (amx -> avx512 -> avx2vnni ->
avx2 -> torch), so a path is one row plus its sources:

    path      CPU flags (cpu_flags)                  builds (kernels/...)                 ops
    amx       AMX tiles, avx512_bf16                 amx_linear.cpp layers.cpp;           packed and int8 linears,
                                                     quant_linear.cpp (+ AMX tiles)       their layer loop; q4
    avx512    AVX-512 F/BW/VL/DQ                     portable.cpp; quant_linear.cpp       linear, norm, activation,
                                                     (+ VNNI)                             attention; q4
    avx2vnni  AVX2 + AVX-VNNI                        quant_linear.cpp                     q4
    avx2      AVX2, FMA, F16C                        portable.cpp; quant_linear.cpp       as avx512
    torch     any                                    none: oneDNN / MKL, torch ops        (bounded, not exact)

`SPECSERVE_CPU_KERNEL` names where the chain starts: auto (default: the fastest path this CPU has whose builds
load), or a path (a path this CPU lacks is refused; `onednn` is torch's old name). Each op then runs on the first
path of the chain from there whose build this CPU has (`SPECSERVE_CPU_FLAGS_OFF` hides flags: a smaller CPU) and
that builds. The portable builds give the same bits as each other, and the quantized builds too, so a capped
path stands in for a smaller CPU in the tests. `specserve kernels` prints the table for the CPU at hand.

Owner of `_MODULES`: this module; each build is loaded once per process, then only read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from model_runtime.kernel_build import build_extension, cpu_flags

log = logging.getLogger(__name__)
KERNELS = Path(__file__).parent / "kernels"

# ops: what a model's forward asks the registry for
LINEAR, RMS_NORM, SILU_MUL, ATTENTION = "linear", "rms_norm", "silu_mul", "attention"  # bf16 and float32 rows
PACKED_LINEAR, INT8_LINEAR, LAYER_LOOP = "packed_linear", "int8_linear", "layer_loop"  # weights packed at load
Q4_LINEAR, Q4_LAYER_LOOP = "q4_linear", "q4_layer_loop"  # the GGUF's codes (--dtype q4)
OPS = (LINEAR, RMS_NORM, SILU_MUL, ATTENTION, PACKED_LINEAR, INT8_LINEAR, LAYER_LOOP, Q4_LINEAR, Q4_LAYER_LOOP)
ROW_OPS = (RMS_NORM, SILU_MUL, ATTENTION)  # one module runs them all (Kernels.rows)
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # bf16 products in hardware (precision.py's auto dtype)


@dataclass(frozen=True)
class Build:
    """One C++ extension: `sources` (and the `headers` they include, hashed into the flags so an edit rebuilds)
    compiled with `cflags` into module `name`, loadable where the CPU has `needs`; its `isa()` returns `isa`.
    `tiles`: the module asks Linux for the AMX tile state once loaded (amx_enable)."""

    name: str
    isa: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cflags: tuple[str, ...]
    needs: frozenset[str]
    ops: tuple[str, ...]
    tiles: bool = False

    @property
    def folder(self) -> str:
        return self.name.removeprefix("specserve_").replace("_", "-")


@dataclass(frozen=True)
class KernelPath:
    """One row of the table: the CPU flags that define the path, the CPUs in words, its builds (each op it
    provides from one of them), and the path it falls back to for the other ops."""

    name: str
    cpus: str
    needs: frozenset[str]
    builds: tuple[Build, ...] = ()
    below: str | None = None
    ops: dict[str, Build] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", {op: b for b in self.builds for op in b.ops})


AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"})
AVX512_VNNI = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma"})
AVX2 = frozenset({"avx2", "fma", "f16c"})
AMX = frozenset({"amx_bf16", "amx_int8", "amx_tile", "avx512_bf16"})
PORTABLE = ("portable.cpp",)
PORTABLE_HEADERS = ("portable_ops.h", "head_blocks.h")
PORTABLE_OPS = (LINEAR, RMS_NORM, SILU_MUL, ATTENTION)
QUANT = ("quant_linear.cpp", "q4_layers.cpp")  # the linears; a q4 model's layer loop
QUANT_HEADERS = ("quant_ops.h", "quant_simd.h", "quant_common.h", "quant_amx.h", "amx_tiles.h", "portable_ops.h",
                 "layer_loop.h")
QUANT_OPS = (Q4_LINEAR, Q4_LAYER_LOOP)
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl")


def _portable(isa: str, flags: tuple[str, ...], needs: frozenset[str]) -> Build:
    return Build(f"specserve_{isa}", isa, PORTABLE, PORTABLE_HEADERS,
                 ("-O3", "-ffp-contract=fast", *flags, "-fopenmp"), needs, PORTABLE_OPS)


def _quant(isa: str, flags: tuple[str, ...], needs: frozenset[str], tiles: bool = False) -> Build:
    return Build(f"specserve_quant_{isa}", isa, QUANT, QUANT_HEADERS, ("-O3", *flags, "-fopenmp"), needs, QUANT_OPS,
                 tiles)


PATHS: tuple[KernelPath, ...] = (  # fastest first; each falls back to `below`
    KernelPath("amx", "Intel Sapphire Rapids and later", AMX, (
        Build("specserve_amx", "amx", ("amx_linear.cpp", "layers.cpp"),
              ("ops.h", "simd.h", "amx_tiles.h", "layer_loop.h", "portable_ops.h"),
              ("-O3", "-mamx-tile", "-mamx-bf16", "-mamx-int8", *AVX512_FLAGS, "-mavx512bf16", "-fopenmp"),
              AMX | {"avx512f", "avx512bw", "avx512vl"}, (PACKED_LINEAR, INT8_LINEAR, LAYER_LOOP), tiles=True),
        _quant("amx", (*AVX512_FLAGS, "-mavx512vnni", "-mfma", "-mamx-tile", "-mamx-int8"),
               AVX512_VNNI | {"amx_tile", "amx_int8"}, tiles=True),
    ), below="avx512"),
    KernelPath("avx512", "AVX-512 without AMX: AMD Zen 4/5, Intel Ice Lake / Skylake servers", AVX512, (
        _portable("avx512", (*AVX512_FLAGS, "-mavx512dq", "-mfma", "-mf16c"), AVX512),
        _quant("avx512", (*AVX512_FLAGS, "-mavx512vnni", "-mfma"), AVX512_VNNI),
    ), below="avx2vnni"),
    KernelPath("avx2vnni", "AVX2 with AVX-VNNI: Intel Alder Lake and later clients", AVX2 | {"avx_vnni"}, (
        _quant("avx2vnni", ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), AVX2 | {"avx_vnni"}),
    ), below="avx2"),
    KernelPath("avx2", "any other x86-64 CPU with AVX2 and FMA", AVX2, (
        _portable("avx2", ("-mavx2", "-mfma", "-mf16c"), AVX2),
        _quant("avx2", ("-mavx2", "-mfma", "-mf16c"), AVX2),
    ), below="torch"),
    KernelPath("torch", "any (opt-in): oneDNN / MKL and torch ops, bounded, not exact", frozenset()),
)
BY_NAME = {p.name: p for p in PATHS}
ALIASES = {"onednn": "torch"}
CHOICES = ("auto", *BY_NAME, *ALIASES)
_MODULES: dict[str, tuple[ModuleType | None, str]] = {}


def requested() -> str:
    """`SPECSERVE_CPU_KERNEL`, checked (ValueError on another name); an alias reads as its path."""
    name = os.environ.get("SPECSERVE_CPU_KERNEL", "auto").strip().lower() or "auto"
    if name not in CHOICES:
        raise ValueError(f"SPECSERVE_CPU_KERNEL={name!r}: choose one of {', '.join(CHOICES)}")
    return ALIASES.get(name, name)


def chain(start: str) -> Iterator[KernelPath]:
    """The paths from `start` down (auto: the whole table)."""
    name: str | None = PATHS[0].name if start == "auto" else start
    while name is not None:
        yield BY_NAME[name]
        name = BY_NAME[name].below


def cpu_has(path: str) -> bool:
    """Whether this CPU has the flags that define a path (torch: any CPU)."""
    return BY_NAME[path].needs <= cpu_flags()


def native_bf16() -> bool:
    """bf16 products in hardware (avx512_bf16 or AMX), as the kernels' choice reads the flags."""
    return bool(BF16_FLAGS & cpu_flags())


def _load(build: Build) -> tuple[ModuleType | None, str]:
    missing = sorted(build.needs - cpu_flags())
    if missing:
        return None, f"off: this CPU lacks {', '.join(missing)}"
    module, why = build_extension(build.name.removeprefix("specserve_"), build.name,
                                  [KERNELS / s for s in build.sources], list(build.cflags), build.folder, build.isa,
                                  tuple(KERNELS / h for h in build.headers))
    if module is None or not build.tiles:
        return module, why
    if not module.amx_enable():
        return None, "off: Linux refused this process the AMX tile state (arch_prctl)"
    if hasattr(module, "set_amx_min_rows"):
        from model_runtime.q4_tiles import configure

        configure(module)
    return module, why


def module(build: Build) -> ModuleType | None:
    """The build loaded (built once per machine, loaded once per process), or None where it cannot run (`status`)."""
    if build.name not in _MODULES:
        _MODULES[build.name] = _load(build)
    return _MODULES[build.name][0]


def status(build: Build) -> str:
    """"built" where the build runs here, else "off: <why>"."""
    return "built" if module(build) is not None else _MODULES[build.name][1]


def build_of(path: str, op: str) -> Build:
    """The build of `path` that provides `op` (KeyError where the path does not)."""
    return BY_NAME[path].ops[op]


def may_run(op: str, start: str | None = None) -> bool:
    """Whether a path of the chain from `start` (None: `requested()`) provides `op` with a build this CPU has the
    flags for, without building it (a failed build is known only when a model loads)."""
    return any(op in p.ops and cpu_has(p.name) and p.ops[op].needs <= cpu_flags()
               for p in chain(start or requested()))


def resolve(op: str, start: str | None = None) -> tuple[str, ModuleType] | None:
    """(path, module) that runs `op` here: the first path of the chain from `start` (None: `requested()`) that
    provides it with a build this CPU has and that loads; None: no kernel of ours runs it."""
    for p in chain(start or requested()):
        if op in p.ops and cpu_has(p.name) and (loaded := module(p.ops[op])) is not None:
            return p.name, loaded
    return None


def _why_not(path: KernelPath) -> str | None:
    """None where `path` runs here: the CPU has it, its first build (the one that defines it) loads, and the
    forward's ops resolve from it; else why not, in words. (Its other builds may fail alone: their ops fall below.)"""
    if not cpu_has(path.name):
        return f"this CPU lacks {path.name} ({', '.join(sorted(path.needs - cpu_flags()))})"
    if path.builds and module(path.builds[0]) is None:
        return f"{path.builds[0].name}: {status(path.builds[0])}"
    if path.name != "torch" and any(resolve(op, path.name) is None for op in PORTABLE_OPS):
        return "no build of the forward's ops loads on its chain"
    return None


def active() -> str:
    """The path a forward built now takes: auto's fastest that runs here (torch last), or the one named (ValueError
    where this CPU cannot run it)."""
    name = requested()
    if name == "auto":
        return next(p.name for p in PATHS if _why_not(p) is None)
    if not cpu_has(name):
        raise ValueError(f"SPECSERVE_CPU_KERNEL={name}: this CPU cannot run it (it has {', '.join(available())})")
    why = _why_not(BY_NAME[name])
    if why is not None:
        raise ValueError(f"SPECSERVE_CPU_KERNEL={name}: {why}")
    return name


def available() -> list[str]:
    """Every path this CPU has the flags for, fastest first (torch last)."""
    return [p.name for p in PATHS if cpu_has(p.name)]


def describe() -> list[str]:
    """The table for the CPU at hand: each path (has it, its builds built or why not) and what each op runs on."""
    flags = sorted(f for f in cpu_flags() if f.startswith(("amx", "avx", "fma", "f16c")))
    lines = [f"CPU flags: {' '.join(flags) or 'none read'}"]
    try:
        chosen = active()
    except ValueError as exc:
        chosen = f"refused ({exc})"
    lines.append(f"SPECSERVE_CPU_KERNEL={os.environ.get('SPECSERVE_CPU_KERNEL', 'auto')}: this process runs {chosen}")
    lines.append("paths (fastest first; each falls back to the next for the ops it lacks):")
    for p in PATHS:
        has = "yes" if cpu_has(p.name) else "no "
        builds = "; ".join(f"{b.name} ({' '.join(b.sources)}): {status(b) if cpu_has(p.name) else 'not here'}"
                           for b in p.builds) or "none: the libraries' kernels"
        lines.append(f"  {p.name:<9} cpu {has}  {builds}")
    lines.append("ops (this process):")
    start = chosen if chosen in BY_NAME else requested()
    for op in OPS:
        found = resolve(op, start)
        lines.append(f"  {op:<14} {found[0] + ' (' + found[1].__name__ + ')' if found else 'none: ' + _fallback(op)}")
    return lines


def _fallback(op: str) -> str:
    if op in PORTABLE_OPS:
        return "torch ops (bounded, not exact)"
    if op in (Q4_LINEAR, Q4_LAYER_LOOP):
        return "--dtype q4 refused"
    return "weights stay unpacked (the linear above)"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for line in describe():
        print(line)
