"""One program per bucket, made at warm-up and run per round: the step's inputs staged into the bucket's device
buffer (one host-to-device copy), the program replayed, its outputs left on the device for the caller to read.

Modes (`CaptureMode`):

    eager              the program's torch ops as they are (the CPU; the reference the others must equal)
    compile            torch.compile(fullgraph=True, dynamic=False) per bucket: one graph, no break (the property
                       CUDA graph capture needs, checked on the CPU by the tests)
    cuda-graph         torch.cuda.CUDAGraph per bucket of the eager ops, captured at warm-up (all buckets in one
                       memory pool), replayed per round
    compile+cuda-graph the compiled program (inductor's fused kernels) captured in our own CUDAGraph per bucket
    reduce-overhead    torch.compile(mode="reduce-overhead"): torch's own CUDA graphs (the pool's tensors and the
                       input buffer marked static)

Warm-up runs every bucket on all-padding inputs (they write only the scratch slots), so capturing never touches a
block the ledger granted. Owner: the worker's compute thread (one program runs at a time). A program's outputs are
valid until the next run of any bucket: the CUDA graphs share one memory pool, so a later graph's intermediates
may lie where an earlier graph's outputs were read (the runner reads or copies them at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from model_runtime.graph.buckets import Bucket
from model_runtime.graph.modes import CUDA_MODES, CaptureMode
from model_runtime.graph.staging import StepInputs, buffer_size, views

Backend = str | Callable[..., object]  # torch.compile's backend: "inductor", "aot_eager", or a callable
Program = Callable[[StepInputs], tuple[torch.Tensor, ...]]
WARM_UP_RUNS = 2  # runs before a capture (allocator and library warm-up, on a side stream)


@dataclass
class _Captured:
    device_flat: torch.Tensor  # the bucket's inputs on the device (a fixed address: the graph reads it)
    host_flat: torch.Tensor  # pinned on CUDA: the staging copy's source
    run: Callable[[], tuple[torch.Tensor, ...]]
    copied: torch.cuda.Event | None = None  # the last staging copy (the host buffer is reused after it)


@dataclass
class WarmUp:
    """What a warm-up took: seconds per bucket, and the device memory the programs hold (CUDA)."""

    seconds: dict[Bucket, float] = field(default_factory=dict)
    memory_bytes: int = 0


def _compiled(program: Program, bucket: Bucket, chain: int, mode: CaptureMode, backend: Backend
              ) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    def on_buffer(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return program(views(flat, bucket, chain))

    if mode == "eager" or mode == "cuda-graph":
        return on_buffer
    options: dict[str, object] = {"fullgraph": True, "dynamic": False}
    if mode == "reduce-overhead":
        options["mode"] = "reduce-overhead"
    else:
        options["backend"] = backend
    return torch.compile(on_buffer, **options)  # type: ignore[arg-type]


class CapturedSteps:
    """A program's captured form per bucket. `static_tensors`: tensors the program writes in place (the KV pool),
    marked static for torch's own CUDA graphs."""

    def __init__(self, program: Program, device: torch.device, mode: CaptureMode, chain: int = 1,
                 backend: Backend = "inductor", static_tensors: Sequence[torch.Tensor] = ()) -> None:
        if mode in CUDA_MODES and device.type != "cuda":
            raise ValueError(f"capture mode {mode!r} needs a CUDA device, not {device}")
        self.program, self.device, self.mode, self.chain, self.backend = program, device, mode, chain, backend
        self._static = tuple(static_tensors)
        self._captured: dict[Bucket, _Captured] = {}
        self._pool: object | None = None  # the CUDA graphs' shared memory pool

    @property
    def buckets(self) -> list[Bucket]:
        return sorted(self._captured)

    def warm_up(self, buckets: Sequence[Bucket], padding: Callable[[Bucket], torch.Tensor]) -> WarmUp:
        """Make every bucket's program; `padding(bucket)`: its all-padding host buffer."""
        if self.mode != "eager":  # dynamic=False: one compile per bucket, all kept; the limits count per process
            # (every CapturedSteps compiles the same code object), so each warm-up adds room for its own
            torch._dynamo.config.recompile_limit += len(buckets)
            torch._dynamo.config.accumulated_recompile_limit += len(buckets)
        report = WarmUp()
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        for bucket in buckets:
            started = time.perf_counter()
            self._captured[bucket] = self._capture(bucket, padding(bucket))
            if cuda:
                torch.cuda.synchronize(self.device)
            report.seconds[bucket] = time.perf_counter() - started
        report.memory_bytes = torch.cuda.memory_reserved(self.device) - before if cuda else 0
        return report

    def _capture(self, bucket: Bucket, padding: torch.Tensor) -> _Captured:
        assert padding.numel() == buffer_size(bucket, self.chain)
        cuda = self.device.type == "cuda"
        host = padding.pin_memory() if cuda else padding.clone()
        flat = host.to(self.device, copy=True)
        fn = _compiled(self.program, bucket, self.chain, self.mode, self.backend)
        if self.mode == "reduce-overhead":
            for t in (flat, *self._static):
                torch._dynamo.mark_static_address(t)
        if self.mode not in ("cuda-graph", "compile+cuda-graph"):
            fn(flat)  # compiles (the modes that compile) here, at warm-up
            return _Captured(flat, host, lambda: fn(flat))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_RUNS):
                fn(flat)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn(flat)
        self._pool = graph.pool()

        def replay() -> tuple[torch.Tensor, ...]:
            graph.replay()
            return outputs

        return _Captured(flat, host, replay)

    def run(self, bucket: Bucket, staged: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The bucket's program on `staged` (its host buffer from staging.stage): its outputs, on the device, valid
        until the next run."""
        captured = self._captured[bucket]
        if captured.copied is not None:
            captured.copied.synchronize()  # the previous step's copy has left the pinned buffer
        captured.host_flat.copy_(staged)
        captured.device_flat.copy_(captured.host_flat, non_blocking=True)
        if self.device.type == "cuda":
            captured.copied = torch.cuda.Event()
            captured.copied.record()
        return captured.run()
