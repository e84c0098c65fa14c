"""Native llama.cpp, as its CPU users run it, beside our engine in `specserve bench spec --llamacpp`.

The binaries come from `scripts/build-llamacpp.sh` (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp,
built with cmake, `-DGGML_NATIVE=ON`, OpenMP with its default wait policy). They run on the very GGUF files our
models are prepared from (cluster/bench/gguf_file.py), on the same prompt token ids (our chat template, applied
once), greedy, with the bench's thread count. Each mode is one `llama-server` of its own on loopback, one slot, its
prompt cache off per request:

  plain        llama-server -m TARGET -t T -tb T
  draft_model  llama-server -m TARGET -md DRAFT -t T -tb T -td T -tbd T --spec-type draft-simple
               --spec-draft-n-max N (llama.cpp's own speculative decoding with the 0.5B draft)

A run POSTs `/completion` with the prompt's token ids (`return_tokens`, temperature 0, top_k 1, every other sampler
off) and times the call end to end from here, prefill included, as ours. The server's own `timings` give the
draft tokens proposed and accepted. The JSON records each binary, the build's flags and commit
(build-info.txt), the CPU, the threads and the wait policy.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from cluster.bench.llamacpp import PLAIN, LlamaCppMissingError, LlamaCppRun, LlamaCppSettings, summarise
from model_runtime.kernel_build import cpu_flags

log = logging.getLogger(__name__)

VERSION = "0.3.36"
NATIVE_MODES = (PLAIN, "draft_model")
BUILD_HINT = ("native llama.cpp is not built: run `scripts/build-llamacpp.sh` (~9 min on 2 cores; it prints the "
              "folder of the binaries), or pass --llamacpp-bin DIR / set SPECSERVE_LLAMACPP_BIN")


AMX_CRASH_HINT = ("llama.cpp's AMX kernels crash in prompt processing on some AMX CPUs (SIGSEGV in "
                  "ggml_backend_amx_mul_mat, ggml-org/llama.cpp#20824): build it without them, "
                  "`LLAMACPP_AMX=OFF scripts/build-llamacpp.sh`, which the bench then prefers on this CPU")


def default_bin_dir() -> Path:
    """Where scripts/build-llamacpp.sh puts the binaries: its native build (on an AMX CPU its build without the AMX
    kernels first, when there is one: the AMX kernels crash there, AMX_CRASH_HINT), else the portable one."""
    configured = os.environ.get("SPECSERVE_LLAMACPP_BIN")
    if configured:
        return Path(configured).expanduser()
    root = Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve")).expanduser() / "llamacpp"
    names = [f"{VERSION}-native-ON", f"{VERSION}-native-ON-noamx", f"{VERSION}-native-OFF"]
    if "amx_int8" in cpu_flags():
        names.insert(0, names.pop(1))
    folders = [root / name / "build" / "bin" for name in names]
    return next((folder for folder in folders if (folder / "llama-server").exists()),
                root / f"{VERSION}-native-ON" / "build" / "bin")  # nothing built: where the script's default goes


def require_binaries(bin_dir: Path | None = None) -> Path:
    """The folder holding llama-server, or LlamaCppMissingError saying how to build it."""
    folder = bin_dir or default_bin_dir()
    if not os.access(folder / "llama-server", os.X_OK):
        raise LlamaCppMissingError(f"{BUILD_HINT} (looked in {folder})")
    return folder


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def build_info(bin_dir: Path) -> dict[str, str]:
    """build-info.txt's lines (written by scripts/build-llamacpp.sh), plus `llama-server --version`."""
    info: dict[str, str] = {}
    path = bin_dir.parent.parent / "build-info.txt"
    if path.exists():
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    try:
        out = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True, timeout=30)
        info["llama-server --version"] = " ".join((out.stdout + out.stderr).split())[:300]
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["llama-server --version"] = f"failed: {exc}"
    return info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    """One llama-server process on loopback. Owner: the NativeLlamaCpp that made it; `close` ends it."""

    def __init__(self, bin_dir: Path, args: list[str], log_path: Path, timeout_s: float = 300.0) -> None:
        self.port = _free_port()
        self.command = [str(bin_dir / "llama-server"), *args, "--host", "127.0.0.1", "--port", str(self.port),
                        "-np", "1", "--no-webui"]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                hint = f" ({AMX_CRASH_HINT})" if self.proc.returncode == -signal.SIGSEGV and "amx_int8" in cpu_flags() \
                    else ""
                raise RuntimeError(f"llama-server exited {self.proc.returncode}{hint}: {log_path.read_text()[-1500:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server not ready in {timeout_s:.0f} s: {log_path.read_text()[-1500:]}")

    def complete(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "top_p": 1.0,
                "min_p": 0.0, "repeat_penalty": 1.0, "samplers": ["top_k"], "cache_prompt": False,
                "return_tokens": True, "stream": False}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class NativeLlamaCpp:
    """The LlamaCppPeer interface (modes, run, report, close) over native llama-server processes."""

    def __init__(self, s: LlamaCppSettings, bin_dir: Path | None = None, log_dir: Path | None = None) -> None:
        self.s = s
        self.bin_dir = require_binaries(bin_dir)
        self.info = build_info(self.bin_dir)
        logs = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        threads = ["-t", str(s.threads), "-tb", str(s.threads)]
        common = ["-m", str(s.model_gguf), "-c", str(s.n_ctx), *threads]
        self.servers: dict[str, _Server] = {}
        try:
            self.servers[PLAIN] = _Server(self.bin_dir, common, logs / "llama-server-plain.log")
            if s.draft_gguf is not None:
                self.servers["draft_model"] = _Server(
                    self.bin_dir, [*common, "-md", str(s.draft_gguf), "-td", str(s.threads), "-tbd", str(s.threads),
                                   "--spec-type", "draft-simple", "--spec-draft-n-max",
                                   str(s.draft_tokens)], logs / "llama-server-draft.log")
        except Exception:
            self.close()
            raise
        self.runs: list[LlamaCppRun] = []
        self._accepted: dict[str, int] = {}  # mode -> draft tokens llama.cpp accepted (its timings)

    def modes(self) -> list[str]:
        return [m for m in NATIVE_MODES if m in self.servers]

    def run(self, mode: str, prompt_id: str, category: str, prompt_ids: list[int], max_tokens: int,
            warmup: bool = False) -> LlamaCppRun:
        server = self.servers[mode]
        start = time.perf_counter()
        out = server.complete(list(prompt_ids), max_tokens)
        seconds = time.perf_counter() - start
        tokens = tuple(int(t) for t in out.get("tokens", []))
        timings = out.get("timings", {})
        drafted = int(timings.get("draft_n", 0))
        run = LlamaCppRun(prompt_id, category, mode, tokens, str(out.get("content", "")), seconds,
                          draft_calls=0, drafted_tokens=drafted)
        run_accepted = int(timings.get("draft_n_accepted", 0))
        if not warmup:
            self.runs.append(run)
            self._accepted[mode] = self._accepted.get(mode, 0) + run_accepted
        return run

    def report(self, our_plain: dict[str, list[int]] | None = None) -> dict[str, Any]:
        settings = {"model_gguf": str(self.s.model_gguf),
                    "draft_gguf": str(self.s.draft_gguf) if self.s.draft_gguf else None,
                    "threads": self.s.threads, "n_ctx": self.s.n_ctx, "draft_tokens": self.s.draft_tokens,
                    "sampling": "greedy (temperature 0, top_k 1, samplers [top_k])", "batch": 1,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default (unset)",
                    "binaries": {mode: server.command for mode, server in self.servers.items()},
                    "cpu": cpu_name()}
        section = summarise(self.runs, our_plain)
        for row in section["modes"]:
            drafted = sum(r.drafted_tokens for r in self.runs if r.mode == row["mode"])
            if drafted:
                row["drafted_tokens"] = drafted
                row["accepted_tokens"] = self._accepted.get(row["mode"], 0)
                row["acceptance_rate"] = row["accepted_tokens"] / drafted
        version = self.info.get("llama-server --version", "?").removeprefix("version: ").split(" built with")[0]
        return {"version": f"{version}, native build", "native": True,
                "build": self.info, "settings": settings, **section}

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
