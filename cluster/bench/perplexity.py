"""`specserve bench perplexity`: the perplexity of a shipped text, in process and through the server, beside native
llama.cpp's `llama-perplexity` on the same GGUF and the same text.

The text: cluster/bench/prompts/perplexity_text.txt (public domain, plain UTF-8: the US Declaration of Independence,
the Gettysburg Address and the first two chapters of Pride and Prejudice, reproduced from memory; ~4k tokens). As
`llama-perplexity -f` reads it, one trailing newline is dropped.

Windows, exactly as llama-perplexity cuts them (llama.cpp tools/perplexity/perplexity.cpp, `perplexity()`, without
--ppl-stride): the text is tokenized once (with the model's BOS where its tokenizer adds one), cut into
len // n_ctx windows of n_ctx tokens (the rest dropped; fewer than 2 * n_ctx tokens is refused, as llama.cpp
refuses), each window's first token replaced by BOS where the model adds one; each window is scored from scratch
and only its second half counts: the predictions of tokens first + 1 .. n_ctx - 1, first = n_ctx / 2, that is
n_ctx - 1 - first tokens per window. Perplexity = exp(mean NLL) over every window's scored tokens, and its
uncertainty as llama.cpp prints it (ppl * sqrt(var(NLL) / (count - 1))).

How each path scores a window (max_tokens 0: the prompt scored, nothing generated):
  in process   a GenerationRequest with SamplingParams(max_tokens=0, prompt_logprobs=0) on an engine of this
               process (build_local_engine, --dtype): its first chunk's `prompt_logprobs` rows, float32
  server       POST /v1/completions {prompt: the window's token ids, echo: true, logprobs: 0, max_tokens: 0} on a
               running `specserve up` (--server HOST:PORT); `choices[0].logprobs.token_logprobs` (the first null),
               read back to float32 (the server writes the shortest decimal of each float32: the bits survive).
               The server's model and dtype come from its /v1/stats; its row is that dtype's
  llama.cpp    `llama-perplexity -m <the model's GGUF> -f <the text> -c N_CTX -t CORES -tb CORES` (OMP_WAIT_POLICY
               PASSIVE: a spinning OpenMP wait stalls it on a shared machine, llamacpp_process.py), its
               "Final estimate: PPL = X +/- Y"; built by scripts/build-llamacpp.sh
`--dtype q4` runs the GGUF's own 4-bit codes with our kernels (model_runtime/quant_weights.py), the weights
llama.cpp runs with its own: their perplexities agreeing checks our q4 arithmetic against an independent
implementation. bf16 runs the checkpoint converted from the same GGUF (its values dequantized, model_runtime/
prepare.py) rounded to bfloat16, with bfloat16 activations: the same model rounded another way, so its ratio to
llama.cpp's measures the rounding, not a kernel's arithmetic.
"""

from __future__ import annotations

import json
import math
import os
import re
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster.bench.runtime import environment, progress, set_threads

TEXT = Path(__file__).parent / "prompts" / "perplexity_text.txt"
DEFAULT_MODEL = "qwen2.5-coder-1.5b"
DEFAULT_N_CTX = 512
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "q4": "q4", "float32": "float32", "fp32": "float32"}
IN_PROCESS, SERVER = "in_process", "server"
FINAL_ESTIMATE = re.compile(r"Final estimate: PPL = ([0-9.eE+-]+) \+/- ([0-9.eE+-]+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


# ---------------------------------------------------------------------- the windows, as llama-perplexity cuts them
def read_text(path: Path = TEXT) -> str:
    """The text as `llama-perplexity -f` reads it: the file, less one trailing newline."""
    return path.read_text(encoding="utf-8").removesuffix("\n")


def bos_of(tokenizer: Any) -> int | None:
    """The BOS id where the tokenizer puts one before a text (llama.cpp's add_bos), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = list(tokenizer("a")["input_ids"])
    return int(bos) if ids and ids[0] == bos else None


def windows(tokens: Sequence[int], n_ctx: int, bos: int | None = None) -> list[list[int]]:
    """llama-perplexity's chunks: len // n_ctx windows of n_ctx consecutive tokens (the remainder dropped), each
    one's first token replaced by `bos` when the model adds one. Fewer than 2 * n_ctx tokens: ValueError."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"the text tokenizes to {len(tokens)} tokens: llama-perplexity needs at least 2 * n_ctx "
                         f"= {2 * n_ctx}")
    out = []
    for start in range(0, len(tokens) // n_ctx * n_ctx, n_ctx):
        window = [int(t) for t in tokens[start:start + n_ctx]]
        if bos is not None:
            window[0] = bos
        out.append(window)
    return out


def first_scored(n_ctx: int) -> int:
    """llama-perplexity's `first = n_ctx/2`: the logits of positions first .. n_ctx - 2 count."""
    return n_ctx // 2


def scored_rows(prompt_logprobs: np.ndarray, n_ctx: int) -> np.ndarray:
    """A window's counted log-probabilities: of its n_ctx - 1 prompt rows (row r: log p(token r+1 | tokens <= r)),
    rows first .. n_ctx - 2, the predictions of tokens first + 1 .. n_ctx - 1."""
    if prompt_logprobs.shape != (n_ctx - 1,):
        raise ValueError(f"expected {n_ctx - 1} prompt rows, got shape {prompt_logprobs.shape}")
    return prompt_logprobs[first_scored(n_ctx):]


@dataclass(frozen=True)
class Estimate:
    ppl: float
    uncertainty: float  # llama.cpp's "+/-": ppl * sqrt(var(NLL) / (count - 1))
    tokens: int


def estimate(logprobs: np.ndarray) -> Estimate:
    """exp(mean NLL) and its uncertainty, as llama-perplexity sums them (float64)."""
    nll = -np.asarray(logprobs, dtype=np.float64)
    count = int(nll.size)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    var = float((nll * nll).mean()) - mean * mean
    return Estimate(ppl, ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0, count)


# ---------------------------------------------------------------------- the runs
@dataclass
class Scores:
    """One path's counted log-probabilities (every window's, in order) for one dtype."""

    dtype: str
    path: str  # IN_PROCESS | SERVER
    logprobs: np.ndarray  # float32
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


def score_in_process(model: str, dtype: str, wins: list[list[int]], label: str = "") -> Scores:
    """Each window scored by an engine of this process in `dtype` (one window at a time, max_tokens 0)."""
    from cluster.engine.factory import build_local_engine
    from cluster.serving.config import NGRAM_DRAFT, make_config
    from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

    n_ctx = len(wins[0])
    config = make_config(model=model, draft=NGRAM_DRAFT, dtype=dtype, max_batch=1, max_context=n_ctx + 16,
                         kv_blocks=None, warm_up=False)
    progress(f"perplexity: loading {model} in {dtype}")
    engine = build_local_engine(model, NGRAM_DRAFT, config.engine_config(), config.local_runtime())
    sampling = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    parts, start = [], time.perf_counter()
    for i, window in enumerate(wins):
        engine.submit(GenerationRequest(f"ppl-{i}", tuple(window), sampling, SpecParams(k=0, draft="none")))
        chunks = engine.run_to_completion()[f"ppl-{i}"]
        rows = next(c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None)
        parts.append(scored_rows(rows.token_logprobs, n_ctx))
        progress(f"perplexity: {label or model} {dtype} in process: window {i + 1}/{len(wins)}, running ppl "
                 f"{estimate(np.concatenate(parts)).ppl:.4f}")
    engine.check_ledger()
    return Scores(engine.dtypes.get("target", dtype), IN_PROCESS, np.concatenate(parts), time.perf_counter() - start)


def http_base(server: str) -> str:
    """`HOST:PORT` or a URL: the HTTP base (the credentials' scheme where none is given)."""
    from cluster.client import Credentials

    if "://" in server:
        return server.rstrip("/")
    return f"{Credentials.from_env().scheme}://{server}"


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
    from cluster.client import Credentials

    creds = Credentials.from_env()
    headers = {"Content-Type": "application/json", **creds.http_headers()}
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    context = ssl.create_default_context(cafile=creds.ca_file) if url.startswith("https") else None
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        return json.loads(response.read())


def server_identity(base: str) -> dict[str, Any]:
    """The served model and its target dtype (GET /v1/stats)."""
    engine = _http(f"{base}/v1/stats", timeout=60)["engine"]
    return {"url": base, "model": engine.get("model"), "dtype": (engine.get("dtype") or {}).get("target")}


def score_server(base: str, model: str, dtype: str, wins: list[list[int]]) -> Scores:
    """Each window scored through the server's OpenAI completions (echo, logprobs 0, max_tokens 0)."""
    n_ctx = len(wins[0])
    parts, start = [], time.perf_counter()
    for i, window in enumerate(wins):
        out = _http(f"{base}/v1/completions", {"model": model, "prompt": window, "echo": True, "logprobs": 0,
                                                "max_tokens": 0, "temperature": 0})
        values = out["choices"][0]["logprobs"]["token_logprobs"]
        if len(values) != n_ctx or values[0] is not None:
            raise RuntimeError(f"server: expected {n_ctx} prompt entries, the first null; got {len(values)}")
        parts.append(scored_rows(np.array(values[1:], np.float64).astype(np.float32), n_ctx))
        progress(f"perplexity: {model} {dtype} server: window {i + 1}/{len(wins)}, running ppl "
                 f"{estimate(np.concatenate(parts)).ppl:.4f}")
    return Scores(dtype, SERVER, np.concatenate(parts), time.perf_counter() - start, {"url": base})


def parse_llama_perplexity(output: str) -> dict[str, Any]:
    """llama-perplexity's final estimate (and chunk count) from its log; RuntimeError without one."""
    final = FINAL_ESTIMATE.search(output)
    if final is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate: {output[-1500:]}")
    chunks = CHUNKS.search(output)
    return {"ppl": float(final.group(1)), "uncertainty": float(final.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None}


def run_llama_perplexity(gguf: Path, text: Path, n_ctx: int, threads: int,
                         bin_dir: Path | None = None) -> dict[str, Any]:
    from cluster.bench.llamacpp import LlamaCppMissingError
    from cluster.bench.llamacpp_native import BUILD_HINT, build_info, default_bin_dir

    folder = bin_dir or default_bin_dir()
    binary = folder / "llama-perplexity"
    if not os.access(binary, os.X_OK):
        raise LlamaCppMissingError(f"{BUILD_HINT} (no llama-perplexity in {folder})")
    command = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "-t", str(threads),
               "-tb", str(threads)]
    progress(f"perplexity: {' '.join(command)}")
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
                          timeout=3600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    return {**parse_llama_perplexity(done.stdout + done.stderr), "command": command, "seconds": seconds,
            "omp_wait_policy": "PASSIVE", "build": build_info(folder)}


def gguf_add_bos(gguf: Path) -> bool:
    """The GGUF's tokenizer.ggml.add_bos_token (llama.cpp's add_bos; absent: false)."""
    import gguf as gguf_lib

    value = gguf_lib.GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(value.contents()) if value is not None else False


# ---------------------------------------------------------------------- the report
def summarise(meta: dict[str, Any], runs: list[Scores], llamacpp: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of `runs` (in process and server, per dtype) and llama.cpp's, JSON-able: per dtype its
    perplexities, whether the server's log-probabilities are the in-process ones bit for bit (else the largest
    difference), and each of ours over llama.cpp's."""
    rows = []
    for dtype in dict.fromkeys(r.dtype for r in runs):
        by_path = {r.path: r for r in runs if r.dtype == dtype}
        row: dict[str, Any] = {"dtype": dtype}
        for path, run in by_path.items():
            est = estimate(run.logprobs)
            row[path] = {"ppl": est.ppl, "uncertainty": est.uncertainty, "tokens": est.tokens,
                         "seconds": round(run.seconds, 2), **run.info}
            if llamacpp is not None:
                row[path]["vs_llamacpp"] = est.ppl / llamacpp["ppl"]
        if IN_PROCESS in by_path and SERVER in by_path:
            a, b = by_path[IN_PROCESS].logprobs, by_path[SERVER].logprobs
            same_shape = a.shape == b.shape
            row["server_vs_in_process"] = {
                "bitwise_equal": bool(same_shape and np.array_equal(a.view(np.int32), b.view(np.int32))),
                "max_abs_diff": float(np.abs(a.astype(np.float64) - b).max()) if same_shape else None,
                "ppl_diff": row[SERVER]["ppl"] - row[IN_PROCESS]["ppl"]}
        rows.append(row)
    return {**meta, "rows": rows, "llamacpp": llamacpp}


def _ppl(entry: dict[str, Any] | None) -> str:
    return "-" if entry is None else f"{entry['ppl']:.4f} +/- {entry['uncertainty']:.4f}"


def format_perplexity(result: dict[str, Any]) -> str:
    llama = result.get("llamacpp")
    bos = "none" if result.get("bos") is None else f"{result['bos']} replaces each window's first token"
    lines = [f"bench perplexity: {result['model']}, {result['text']}: {result['text_tokens']} tokens, n_ctx "
             f"{result['n_ctx']}: {result['windows']} windows, {result['scored_tokens']} tokens scored (the second "
             f"half of each window, as llama-perplexity); BOS: {bos}"]
    headers = f"{'dtype':<10} {'in process':>20} {'server':>20}  {'server = in process':<28}"
    if llama is not None:
        headers += f" {'ours / llama.cpp':>16}"
    lines.append(headers)
    for row in result["rows"]:
        cmp = row.get("server_vs_in_process")
        if cmp is None:
            same = "-"
        elif cmp["bitwise_equal"]:
            same = "bitwise equal"
        else:
            same = f"differ: max |d| {cmp['max_abs_diff']:.3g}, ppl {cmp['ppl_diff']:+.3g}"
        line = f"{row['dtype']:<10} {_ppl(row.get(IN_PROCESS)):>20} {_ppl(row.get(SERVER)):>20}  {same:<28}"
        if llama is not None:
            ratios = [f"{row[p]['vs_llamacpp']:.4f}" for p in (IN_PROCESS, SERVER) if p in row]
            line += f" {' / '.join(dict.fromkeys(ratios)):>16}"
        lines.append(line)
    if llama is not None:
        lines.append(f"llama.cpp  {_ppl(llama):>20}  (llama-perplexity on {Path(llama['command'][2]).name}, "
                     f"{llama.get('chunks')} chunks, {llama['seconds']:.0f} s)")
    if result.get("server") is not None:
        s = result["server"]
        lines.append(f"server: {s['url']} serving {s['model']} in {s['dtype']}")
    lines.extend(f"note: {note}" for note in result.get("notes", []))
    return "\n".join(lines)


# ---------------------------------------------------------------------- the bench
@dataclass(frozen=True)
class PerplexitySettings:
    model: str = DEFAULT_MODEL
    dtypes: tuple[str, ...] = ("bfloat16", "q4")
    n_ctx: int = DEFAULT_N_CTX
    text: Path = TEXT
    server: str | None = None
    llamacpp: bool = False
    llamacpp_bin: Path | None = None
    threads: int = 2
    llamacpp_threads: int = field(default_factory=lambda: os.cpu_count() or 1)


def run_perplexity_bench(s: PerplexitySettings) -> dict[str, Any]:
    from cluster.engine.factory import load_tokenizer, model_dir

    set_threads(s.threads)
    env = environment()
    tokenizer = load_tokenizer(model_dir(s.model))
    tokens = list(tokenizer(read_text(s.text))["input_ids"])
    bos = bos_of(tokenizer)
    wins = windows(tokens, s.n_ctx, bos)
    progress(f"perplexity: {len(tokens)} tokens, {len(wins)} windows of {s.n_ctx}")
    notes: list[str] = []
    server = None
    if s.server is not None:
        server = server_identity(http_base(s.server))
        if server["model"] != s.model:
            notes.append(f"the server serves {server['model']}, not {s.model}: its figures are its model's")
    runs = [score_in_process(s.model, dtype, wins) for dtype in s.dtypes]
    if server is not None:
        runs.append(score_server(server["url"], server["model"], server["dtype"], wins))
    llama = None
    if s.llamacpp:
        from cluster.bench.gguf_file import gguf_path

        gguf = gguf_path(s.model)
        if gguf_add_bos(gguf) != (bos is not None):
            notes.append(f"BOS differs: the GGUF's add_bos_token is {gguf_add_bos(gguf)}, our tokenizer's "
                         f"{bos is not None}")
        llama = run_llama_perplexity(gguf, s.text, s.n_ctx, s.llamacpp_threads, s.llamacpp_bin)
        if llama["chunks"] is not None and llama["chunks"] != len(wins):
            notes.append(f"llama.cpp cut {llama['chunks']} chunks, we {len(wins)}: the tokenizations differ")
    env["loadavg_at_end"] = list(os.getloadavg())
    meta = {"model": s.model, "text": s.text.name, "text_tokens": len(tokens), "n_ctx": s.n_ctx,
            "windows": len(wins), "scored_tokens": len(wins) * (s.n_ctx - 1 - first_scored(s.n_ctx)), "bos": bos,
            "server": server, "environment": env, "notes": notes,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return summarise(meta, runs, llama)
