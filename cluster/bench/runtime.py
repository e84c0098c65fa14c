"""`specserve bench runtime`: the forward-pass costs that decide whether speculation pays.

For each model and context length c (docs/contracts.md needs t_1 and t_verify(k)):

    prefill_ms     our prefill of the c-token context itself (one forward of c rows; a prompt's cost before its
                   first token), and prefill_tok_s = c / prefill_ms
    decode_ms      our one-token step at past length c                              (t_1)
    score[n]       our step scoring n new tokens at past length c, n = 1..max_k;
                   ratio = t(n) / t(1), the price of verifying n - 1 drafts plus the bonus
    hf_decode_ms   transformers' own one-token step at past length c (DynamicCache), on the
                   very same weight tensors (shared, not copied) and the same KV contents
    ours_vs_hf     decode_ms / hf_decode_ms (goal <= 1.0)

Every figure is the median of `repeats` after `warmup` untimed rounds; within a round all
variants run back to back, and ratios are medians of the per-round ratios, so load from other
processes on a shared machine shifts numerator and denominator together.
No state grows between repeats: each timed step writes the same slots at past length c and is
forgotten (ours: the sequence length is not advanced; transformers: the cache is cropped back).

Also the shared helpers of the benchmark commands (threads, progress lines, medians, and a
transformers model that shares our weight tensors).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from model_runtime.packed_weight import PackedBF16, as_tensor
from model_runtime.precision import target_dtype
from model_runtime.quant_weights import QuantLinear

BLOCK_SIZE = 16


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    progress(f"torch threads: {torch.get_num_threads()}")


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def environment() -> dict[str, Any]:
    import transformers

    from cluster.bench.llamacpp_native import cpu_name
    from model_runtime.cpu_kernels import active

    return {
        "cpu": cpu_name(),
        "cpu_kernel": active(),  # model_runtime/cpu_kernels.py: the path our forwards take here
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg_at_start": list(os.getloadavg()),
    }


def default_models() -> list[str]:
    from model_runtime.registry import KNOWN_MODELS

    return sorted(KNOWN_MODELS, key=lambda name: KNOWN_MODELS[name].size_bytes)


def hf_model_sharing_weights(ours: CausalLM, checkpoint_dir: str | Path) -> torch.nn.Module:
    """A transformers CausalLM whose parameters are views of `ours`' tensors (no second copy).

    Our fused tensors are row-stacked (qkv = [q; k; v], gate_up = [gate; up]), so each of
    transformers' projections is a contiguous row slice of ours. Weights packed for the AMX kernel
    (model_runtime/packed_weight.py) are unpacked into copies: in bf16 on such a CPU the second copy exists. Built on the meta device, then
    every parameter is replaced; rotary buffers are rebuilt on the real device.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    assert ours.tp_size == 1, "sharing needs the unsharded weights"
    config = AutoConfig.from_pretrained(str(checkpoint_dir))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=ours.dtype)
    w, cfg = ours.weights, ours.config
    lm_head = w.embed if cfg.tie_word_embeddings else as_tensor(w.lm_head)
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shared: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm, "lm_head.weight": lm_head}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        q, k, v = as_tensor(lw.qkv).split([q_rows, kv_rows, kv_rows])
        gate, up = as_tensor(lw.gate_up).chunk(2)
        shared.update({
            p + "input_layernorm.weight": lw.input_norm, p + "post_attention_layernorm.weight": lw.post_norm,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": as_tensor(lw.o), p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": as_tensor(lw.down),
        })
        if lw.qkv_bias is not None:
            qb, kb, vb = lw.qkv_bias.split([q_rows, kv_rows, kv_rows])
            shared.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                           p + "self_attn.v_proj.bias": vb})
    names = {name for name, _ in hf.named_parameters(remove_duplicate=False)}
    assert names == set(shared), f"unexpected parameters: {sorted(names ^ set(shared))[:6]}"
    for name, tensor in shared.items():
        module_name, _, attr = name.rpartition(".")
        module = hf.get_submodule(module_name)
        assert getattr(module, attr).shape == tensor.shape, name
        setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(config=hf.config).to(ours.device)
    stray = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.device.type == "meta"]
    assert not stray, f"left on the meta device: {stray}"
    return hf.eval()


def hf_cache_from_pool(hf: torch.nn.Module, ours: CausalLM, kv: Any, block_table: list[int], length: int) -> Any:
    """A DynamicCache holding the first `length` positions of our paged KV (keys already rotated)."""
    from transformers import DynamicCache

    cfg = ours.config
    blocks = torch.tensor(block_table, dtype=torch.long)
    cache = DynamicCache(config=hf.config)
    for layer in range(cfg.num_layers):
        k, v = (pool[layer][blocks].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:length] for pool in (kv.k, kv.v))
        cache.update(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), layer)
    return cache


@dataclass
class RuntimeSettings:
    models: list[str] = field(default_factory=default_models)
    contexts: list[int] = field(default_factory=lambda: [128, 1024])
    max_k: int = 8
    repeats: int = 5
    warmup: int = 1
    threads: int = 2
    compare_hf: bool = True
    dtype: str = "float32"  # the models' precision: float32, bfloat16 or auto (model_runtime/precision.py)

    def __post_init__(self) -> None:
        assert self.contexts and all(c >= 1 for c in self.contexts), self.contexts
        assert self.max_k >= 1 and self.repeats >= 1 and self.warmup >= 0, (self.max_k, self.repeats, self.warmup)


def _bench_context(ours: CausalLM, hf: torch.nn.Module | None, context: int, s: RuntimeSettings,
                   gen: torch.Generator) -> dict[str, Any]:
    vocab = ours.config.vocab_size
    num_blocks = -(-(context + s.max_k) // BLOCK_SIZE) + 1
    alloc, kv, seq = LocalAllocator(num_blocks, BLOCK_SIZE), ours.allocate_kv(num_blocks, BLOCK_SIZE), LocalSequence()
    ours.forward_seqs([alloc.extend(seq, torch.randint(vocab, (context,), generator=gen).tolist(), "last")], kv)
    new_tokens = torch.randint(vocab, (s.max_k,), generator=gen).tolist()
    steps = {}
    for n in range(1, s.max_k + 1):  # slots context .. context+n-1; the length moves back after each
        steps[n] = alloc.extend(seq, new_tokens[:n])
        seq.length = context
    hf_step: Callable[[], Any] | None = None
    parity = None
    if hf is not None:
        cache = hf_cache_from_pool(hf, ours, kv, seq.block_table, context)
        step_input = torch.tensor([new_tokens[:1]])

        def hf_step() -> torch.Tensor:
            with torch.inference_mode():
                logits = hf(input_ids=step_input, past_key_values=cache, use_cache=True).logits
            cache.crop(-1)
            return logits

        (ours_logits,) = ours.forward_seqs([steps[1]], kv)
        parity = float((hf_step()[0, -1].float() - ours_logits[-1]).abs().max())
    ours_ms: dict[int, list[float]] = {n: [] for n in steps}
    hf_ms: list[float] = []
    prefill_ms: list[float] = []
    context_tokens = torch.randint(vocab, (context,), generator=gen).tolist()
    pre_blocks = -(-context // BLOCK_SIZE)
    pre_alloc, pre_kv = LocalAllocator(pre_blocks, BLOCK_SIZE), ours.allocate_kv(pre_blocks, BLOCK_SIZE)
    for rep in range(s.warmup + s.repeats):
        pre_seq = LocalSequence()
        prefill = pre_alloc.extend(pre_seq, context_tokens, "last")
        round_prefill = 1e3 * timed(lambda prefill=prefill: ours.forward_seqs([prefill], pre_kv))
        pre_alloc.free(pre_seq)
        # one untimed step first: the prefill's pool and activations pushed the steps' KV out of the caches, and the
        # step timed first paid for it (at context 2048 one row read 69-83 ms against 53-55 mid-stream, 2026-12-05)
        ours.forward_seqs([steps[1]], kv)
        round_ours = {n: 1e3 * timed(lambda step=step: ours.forward_seqs([step], kv)) for n, step in steps.items()}
        round_hf = 1e3 * timed(hf_step) if hf_step is not None else None
        if rep >= s.warmup:
            prefill_ms.append(round_prefill)
            for n, ms in round_ours.items():
                ours_ms[n].append(ms)
            if round_hf is not None:
                hf_ms.append(round_hf)
    one = ours_ms[1]
    result: dict[str, Any] = {
        "context": context,
        "prefill_ms": median(prefill_ms),
        "prefill_tok_s": context / (median(prefill_ms) / 1e3),
        "decode_ms": median(one),
        "score": [{"tokens": n, "ms": median(ms), "ratio": median([a / b for a, b in zip(ms, one, strict=True)])}
                  for n, ms in ours_ms.items()],
        "samples_ms": {"ours": {str(n): ms for n, ms in ours_ms.items()}, "hf": hf_ms, "prefill": prefill_ms},
    }
    if hf_ms:
        result.update({"hf_decode_ms": median(hf_ms),
                       "ours_vs_hf": median([a / b for a, b in zip(one, hf_ms, strict=True)]),
                       "hf_logits_max_abs_diff": parity})
    return result


def bench_model(name: str, s: RuntimeSettings) -> dict[str, Any]:
    from model_runtime.prepare import prepare_model

    checkpoint = prepare_model(name)
    progress(f"runtime: loading {name}")
    start = time.perf_counter()
    ours = CausalLM.load(checkpoint, dtype=target_dtype(s.dtype, "cpu", checkpoint))
    load_s = time.perf_counter() - start
    hf = hf_model_sharing_weights(ours, checkpoint) if s.compare_hf else None
    params = sum(t.numel() for t in {id(t): t for t in _weight_tensors(ours)}.values())
    streamed = linear_bytes(ours)
    gen = torch.Generator().manual_seed(0)
    contexts = []
    for context in s.contexts:
        progress(f"runtime: {name} context {context}: {s.warmup}+{s.repeats} rounds of n = 1..{s.max_k}"
                 + (" + transformers" if hf is not None else ""))
        contexts.append(_bench_context(ours, hf, context, s, gen))
        c = contexts[-1]
        c["weights_gb_per_s"] = streamed / (c["decode_ms"] / 1e3) / 1e9
        progress(f"runtime: {name} context {context}: prefill {c['prefill_ms']:.1f} ms "
                 f"({c['prefill_tok_s']:.0f} tok/s), decode {c['decode_ms']:.1f} ms, "
                 f"{c['weights_gb_per_s']:.1f} GB/s of linear weights"
                 + (f", transformers {c['hf_decode_ms']:.1f} ms" if "hf_decode_ms" in c else ""))
    return {"model": name, "checkpoint": str(checkpoint), "parameters": params, "dtype": str(ours.dtype),
            "linear_kernel": ours.linear_kernel, "linear_weight_bytes": streamed,
            "load_seconds": load_s, "contexts": contexts}


def linear_bytes(model: CausalLM) -> int:
    """Bytes of the linears' weights, which one decode step streams once (the embedding is read by row)."""
    def size(w: object) -> int:
        if isinstance(w, torch.Tensor):
            return w.numel() * w.element_size()
        if isinstance(w, QuantLinear):
            return w.nbytes
        packed = getattr(w, "packed", None)
        return size(packed) + size(getattr(w, "scale", None)) if packed is not None else 0

    w = model.weights
    return size(w.lm_head) + sum(size(x) for lw in w.layers for x in (lw.qkv, lw.o, lw.gate_up, lw.down))


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """The machine's memory bandwidth as a copy of `gib` GiB moves it (bytes read + written per second)."""
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    seconds = median([timed(lambda: dst.copy_(src)) for _ in range(repeats)])
    return 2 * src.numel() * 4 / seconds


def _weight_tensors(model: CausalLM) -> list[torch.Tensor | PackedBF16]:
    w = model.weights
    out = [w.embed, w.final_norm] + ([] if model.config.tie_word_embeddings else [w.lm_head])
    for lw in w.layers:
        out += [t for t in (lw.input_norm, lw.qkv, lw.qkv_bias, lw.o, lw.post_norm, lw.gate_up, lw.down) if t is not None]
    return out


def run_runtime_bench(s: RuntimeSettings) -> dict[str, Any]:
    set_threads(s.threads)
    env = environment()
    env["copy_gb_per_s"] = copy_bandwidth() / 1e9
    progress(f"runtime: this machine copies {env['copy_gb_per_s']:.1f} GB/s (read + write, {s.threads} threads)")
    models = []
    for name in s.models:
        models.append(bench_model(name, s))
    env["loadavg_at_end"] = list(os.getloadavg())
    return {"bench": "runtime", "settings": asdict(s), "environment": env, "models": models}
