"""Our own forward pass for the Llama/Qwen2 family over a paged KV pool, tensor parallel by heads.

One call serves a ragged batch (prefill, one-token decode and multi-token verify together);
see model_runtime/batch.py for the slot layout. Logits come back only for the rows the batch
asks for, and only on rank 0 (other ranks return an empty tensor).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model_runtime import cpu_kernels, precision
from model_runtime.attention import kernel_head_dim, paged_attention
from model_runtime.batch import ForwardBatch, SeqInput
from model_runtime.config import ModelConfig
from model_runtime.kv_pool import KVPool
from model_runtime.packed_weight import PackedBF16, PackedInt8
from model_runtime.quant_formats import UnsupportedQuantError
from model_runtime.quant_weights import QuantLinear
from model_runtime.small_matmul import calibrate_all, linear
from model_runtime.weights import LayerWeights, ModelWeights, load_quant_weights, load_weights, pack_weights

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: ModuleType | None = None) -> torch.Tensor:
    """`rows`: the model's row-op kernels (Kernels.rows: the torch formula's roundings in one pass, a row's bits
    independent of the call); None: the torch formula."""
    if rows is not None and x.dim() == 2:
        return rows.rms_norm(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul(gate_up: torch.Tensor, rows: ModuleType | None = None) -> torch.Tensor:
    """silu(gate) * up of the MLP's fused gate|up output [T, 2I] -> [T, I]; `rows` as in rms_norm."""
    if rows is not None and gate_up.dim() == 2:  # one pass with F.silu's and the product's roundings
        return rows.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, D] of each position; sin's first half negated, so that `apply_rope` rotates with one roll
    (x * cos + roll(x) * sin == transformers' x * cos + rotate_half(x) * sin, bitwise: (-a) * b == a * (-b))."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    half = head_dim // 2
    sin = emb.sin().to(dtype)
    sin[:, :half].neg_()
    return emb.cos().to(dtype), sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D] from `rope_cos_sin` (sin's first half negated)."""
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, dims=-1) * sin[:, None, :]


def _packed_for_cpu(weights: ModelWeights, int8: bool) -> tuple[ModelWeights, str, cpu_kernels.Kernels]:
    """The weights as the linears will run them, the linears' kernel name (the registry path whose build runs them,
    "-int8" after it for int8 weights, "q4-" before the q4 build's; "torch": the libraries, or CUDA) and the model's
    kernels (model_runtime/cpu_kernels.py, from the kernel registry)."""
    dtype, device = weights.embed.dtype, weights.embed.device
    kernels = cpu_kernels.for_dtype(dtype, device)
    if isinstance(weights.lm_head, QuantLinear):
        if not kernels.exact:
            raise UnsupportedQuantError("--dtype q4 needs our float32 kernels around its linears, and this process "
                                        "runs the libraries' (`specserve kernels` says why)")
        return weights, f"q4-{weights.lm_head.isa}", kernels
    if kernels.packed is not None:  # a path that packs bf16 weights once at load (and int8 ones)
        if int8:
            return pack_weights(weights, PackedInt8), f"{kernels.path}-int8", kernels
        return pack_weights(weights), kernels.path, kernels
    if int8:
        log.warning("int8 linears need a kernel that packs them (%s): running bfloat16", kernels.packed_why)
    if not kernels.exact and device.type == "cpu":
        log.warning("SPECSERVE_CPU_KERNEL=torch: the libraries' kernels, whose rows depend on the call's shape: "
                    "greedy speculative output is bounded, not exact (docs/exactness.md)")
    return weights, kernels.path, kernels


class CausalLM:
    """Stateless over requests: all per-sequence state (past length, blocks, slots) comes in the batch."""

    def __init__(
        self, config: ModelConfig, weights: ModelWeights, tp_rank: int = 0, tp_size: int = 1,
        group: dist.ProcessGroup | None = None, int8: bool = False,
    ) -> None:
        self.config = config
        self.weights, self.linear_kernel, self.kernels = _packed_for_cpu(weights, int8)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.group = group
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.dtype = self.weights.embed.dtype  # the activations' and the KV cache's
        self.device = self.weights.embed.device
        first = self.weights.layers[0]
        # MKL's few-row block widths, timed per shape: only where the libraries run the linears (not our kernels)
        self.matmul_widths = {} if self.kernels.linear is not None else calibrate_all(
            [first.qkv, first.o, first.gate_up, first.down, self.weights.lm_head])
        self._stack = self._layer_stack()  # the decoder layers as one C++ loop, or None: the Python loop

    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, tp_rank: int = 0, tp_size: int = 1,
        group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> CausalLM:
        """`dtype` torch.int8: int8 linears (W8A8, per-row activations) on the registry's packed kernel, bfloat16
        elsewhere in the model; a draft's precision (`--draft-dtype int8`). Where no such kernel runs, plain bfloat16.
        `dtype` precision.Q4 (`--dtype q4`): the GGUF's quantized linears, float32 elsewhere (quant_weights.py)."""
        config = ModelConfig.from_dir(checkpoint_dir)
        if dtype == precision.Q4:
            from model_runtime import quant_kernels
            from model_runtime.prepare import prepare_quant

            module = quant_kernels.active()
            if module is None:
                raise UnsupportedQuantError(f"--dtype q4: no quantized kernel runs here ({quant_kernels.describe()})")
            prepare_quant(Path(checkpoint_dir))
            return cls(config, load_quant_weights(checkpoint_dir, config, module, tp_rank, tp_size), tp_rank, tp_size,
                       group)
        int8 = dtype == torch.int8
        weights = load_weights(checkpoint_dir, config, tp_rank, tp_size, dtype=torch.bfloat16 if int8 else dtype,
                               device=device)
        return cls(config, weights, tp_rank, tp_size, group, int8=int8)

    def _layer_stack(self) -> object | None:
        """The decoder layers as one C++ loop over the kernels (kernels/layers.cpp), for a model whose every linear is
        packed, on one rank; None elsewhere (the Python loop below: the same operations). A q4 model's loop is
        kernels/q4_layers.cpp's. Both loops run the portable row ops (Kernels.rows), which take any key width."""
        if isinstance(self.weights.lm_head, QuantLinear):
            return self._q4_layer_stack()
        module, rows, d = self.kernels.packed, self.kernels.rows, self.config.head_dim
        if module is None or rows is None or self.tp_size != 1 or not kernel_head_dim(d) or not self.weights.layers:
            return None
        if not all(isinstance(w, PackedBF16 | PackedInt8)
                   for lw in self.weights.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)):
            return None

        def lin(w: PackedBF16 | PackedInt8) -> tuple[torch.Tensor, torch.Tensor | None, int]:
            return w.packed, w.scale if isinstance(w, PackedInt8) else None, w.shape[0]

        layers = [(lw.input_norm, lw.post_norm, lw.qkv_bias, lin(lw.qkv), lin(lw.o), lin(lw.gate_up), lin(lw.down))
                  for lw in self.weights.layers]
        return module.LayerStack(layers, self.num_heads, self.num_kv_heads, d, self.config.rms_norm_eps, d ** -0.5,
                                 rows.ops())

    def _q4_layer_stack(self) -> object | None:
        """kernels/q4_layers.cpp's loop for a q4 model whose every layer linear is quantized, on one rank, where the
        portable kernels run its attention (kernel_head_dim); None elsewhere (the Python loop)."""
        rows, d = self.kernels.rows, self.config.head_dim
        linears = [w for lw in self.weights.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        if rows is None or not hasattr(rows, "ops") or self.tp_size != 1 or not kernel_head_dim(d) or not linears \
                or not all(isinstance(w, QuantLinear) for w in linears):
            return None
        module = linears[0].kernels

        def parts(w: QuantLinear) -> list[tuple[torch.Tensor, int, int, int, int]]:
            return [(p.packed, p.n, p.bits, p.superblock, p.block) for p in w.parts]

        layers = [(lw.input_norm, lw.post_norm, lw.qkv_bias, parts(lw.qkv), parts(lw.o), parts(lw.gate_up),
                   parts(lw.down)) for lw in self.weights.layers]
        return module.Q4LayerStack(layers, self.num_heads, self.num_kv_heads, d, self.config.rms_norm_eps, d ** -0.5,
                                   rows.ops())

    def allocate_kv(self, num_blocks: int, block_size: int) -> KVPool:
        return KVPool.allocate(self.config, num_blocks, block_size, self.tp_size, self.dtype, self.device)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    @torch.inference_mode()
    def forward_seqs(self, seqs: list[SeqInput], kv: KVPool) -> list[torch.Tensor]:
        """Convenience: build the batch, run it, split logits per sequence ([rows_i, V] each)."""
        batch = ForwardBatch.build(seqs, kv.block_size)
        logits = self.forward(batch, kv)
        if self.tp_rank != 0:
            return [logits for _ in seqs]
        return list(torch.split(logits, batch.logits_counts))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        cfg = self.config
        batch = batch.to(self.device)
        cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        h = F.embedding(batch.token_ids, self.weights.embed)
        rows, lin = self.kernels.rows, self.kernels.linear
        if self._stack is not None:
            groups = [(g.slots, g.rows, g.hidden, g.real) for g in batch.attention]
            h = self._stack.forward(h, cos, sin, batch.slot_mapping, kv.k, kv.v, groups)  # type: ignore[attr-defined]
        else:
            for layer_idx, lw in enumerate(self.weights.layers):
                x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps, rows)
                h = h + self._attention(layer_idx, lw, x, cos, sin, batch, kv)
                x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps, rows)
                h = h + self._all_reduce(linear(silu_mul(linear(x, lw.gate_up, kernel=lin), rows), lw.down, kernel=lin))
        if self.tp_rank != 0 or batch.logits_rows.numel() == 0:
            return torch.empty(0, cfg.vocab_size, dtype=torch.float32)
        h = rms_norm(h[batch.logits_rows], self.weights.final_norm, cfg.rms_norm_eps, rows)
        if isinstance(self.weights.lm_head, PackedBF16 | PackedInt8 | QuantLinear):
            return self.weights.lm_head(h, out_fp32=True)  # float32 logits (bf16's straight from the accumulators)
        if lin is not None:
            return lin.linear(h, self.weights.lm_head, None, True)  # float32 logits, as the packed kernels'
        return linear(h, self.weights.lm_head).float()

    def _attention(
        self, layer_idx: int, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch, kv: KVPool,
    ) -> torch.Tensor:
        d, hq, hkv = self.config.head_dim, self.num_heads, self.num_kv_heads
        tokens = x.shape[0]
        lin = self.kernels.linear
        qk, v = linear(x, lw.qkv, lw.qkv_bias, kernel=lin).split([(hq + hkv) * d, hkv * d], dim=-1)
        q, k = apply_rope(qk.reshape(tokens, hq + hkv, d), cos, sin).split([hq, hkv], dim=1)  # q and k in one
        v = v.view(tokens, hkv, d)
        k_flat, v_flat = kv.k[layer_idx].view(-1, hkv, d), kv.v[layer_idx].view(-1, hkv, d)
        k_flat.index_copy_(0, batch.slot_mapping, k)
        v_flat.index_copy_(0, batch.slot_mapping, v)
        # a row alike however many share the call
        out = paged_attention(q, k_flat, v_flat, batch.attention, rows=self.kernels.rows)
        return self._all_reduce(linear(out.view(tokens, hq * d), lw.o, kernel=lin))
