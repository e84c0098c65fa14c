"""Which forward a worker runs: the config's `capture` setting resolved against the worker's device, ranks and
precision (no torch here: the config validates with it before anything loads).

    off       the eager forward (CausalLM.forward_seqs): today's path, the CPU's C++ kernels, q4, AMX
    auto      cuda-graph on a CUDA device, one rank, float32/bfloat16 weights; off everywhere else (so the CPU's
              default path never changes); a capture that fails at start-up (the device's memory, a driver's
              refusal) is logged and the worker runs the eager forward: auto never costs a worker its start
    a mode    capture.py's modes: eager, compile, cuda-graph, compile+cuda-graph, reduce-overhead; refused
              (CaptureUnsupportedError) where it cannot run: a CUDA mode on another device, TP > 1, weights the
              captured forward does not run (q4, int8, float16)

A worker that captures builds a CapturedRunner over its model (runner.py) whose pool is the worker's KV pool, with
the buckets `CaptureSettings.plan` sizes from the engine's max_batch, k_max + 1 rows and max_context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from model_runtime.graph.buckets import Buckets

CaptureMode = Literal["eager", "compile", "cuda-graph", "compile+cuda-graph", "reduce-overhead"]
CAPTURE_MODES: tuple[CaptureMode, ...] = get_args(CaptureMode)
CUDA_MODES: tuple[CaptureMode, ...] = ("cuda-graph", "compile+cuda-graph", "reduce-overhead")
CaptureSetting = Literal["off", "auto", CaptureMode]  # the config's `capture` (ClusterConfig)
CAPTURE_SETTINGS: tuple[str, ...] = get_args(CaptureSetting)
CAPTURABLE_DTYPES = ("float32", "bfloat16")  # static_forward.StaticModel.of: plain float32/bfloat16 tensors
AUTO_MODE: CaptureMode = "cuda-graph"


class CaptureUnsupportedError(ValueError):
    """A capture setting this worker cannot run (the device, the ranks, the weights' precision)."""


def capture_mode(setting: str, device: str, tp_size: int = 1, dtype: str = "auto") -> CaptureMode | None:
    """The mode a worker on `device` with `tp_size` ranks and weights of `dtype` (a precision name; "auto": not yet
    resolved, taken as capturable) runs for `setting`; None: the eager forward."""
    if setting not in CAPTURE_SETTINGS:
        raise CaptureUnsupportedError(f"capture: unknown setting {setting!r}; choose {', '.join(CAPTURE_SETTINGS)}")
    cuda = str(device).startswith("cuda")
    capturable = dtype == "auto" or dtype in CAPTURABLE_DTYPES
    if setting == "off":
        return None
    if setting == "auto":
        return AUTO_MODE if cuda and tp_size == 1 and capturable else None
    if setting in CUDA_MODES and not cuda:
        raise CaptureUnsupportedError(f"capture: {setting!r} needs a CUDA device, not {device!r} (eager and compile "
                                      "run on the CPU; auto runs the eager forward there)")
    if tp_size != 1:
        raise CaptureUnsupportedError(f"capture: {setting!r} runs one rank, not tensor_parallel_size {tp_size} "
                                      "(capture off or auto: the eager forward over the ranks)")
    if not capturable:
        raise CaptureUnsupportedError(f"capture: {setting!r} runs plain {' or '.join(CAPTURABLE_DTYPES)} weights, "
                                      f"not {dtype} (set that model's dtype to one of them, or capture off)")
    return setting  # type: ignore[return-value]


@dataclass(frozen=True)
class CapturePlan:
    """What a worker's CapturedRunner is made with: the mode, its buckets, torch.compile's backend."""

    mode: CaptureMode
    buckets: Buckets
    backend: str = "inductor"
    fallback: bool = False  # auto's plan: a capture that fails at start-up leaves the worker on the eager forward


@dataclass(frozen=True)
class CaptureSettings:
    """The config's `capture` and the engine's sizes, carried to a worker (in process, or a Serve deployment's
    arguments), which resolves them against its own device, ranks and precision (`plan`)."""

    setting: str = "off"
    max_batch: int = 1
    k_max: int = 0
    max_context: int = 2048
    backend: str = "inductor"  # the compile modes' torch.compile backend ("aot_eager": the tests)

    def __post_init__(self) -> None:
        capture_mode(self.setting, "cuda", 1)  # a known setting (the device checks come with the worker's)
        assert self.max_batch >= 1 and self.k_max >= 0 and self.max_context >= 1, self

    def plan(self, device: str, tp_size: int, dtype: str, block_size: int,
             max_positions: int | None = None) -> CapturePlan | None:
        """The worker's plan (None: the eager forward); its buckets: Buckets.up_to(max_batch, k_max + 1 rows,
        max_context capped at the model's `max_positions`, as the engine caps its contexts).
        CaptureUnsupportedError where the setting names a mode this worker cannot run."""
        mode = capture_mode(self.setting, device, tp_size, dtype)
        if mode is None:
            return None
        context = self.max_context if max_positions is None else min(self.max_context, max_positions)
        return CapturePlan(mode, Buckets.up_to(self.max_batch, self.k_max + 1, context, block_size),
                           self.backend, fallback=self.setting == "auto")
