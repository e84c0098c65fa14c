"""Every kernel path this CPU can run (model_runtime/kernel_registry.py: amx, avx512, avx2), op by op on the real
models' shapes: a row's bits are the same decoded alone, verified among k+1 rows (k up to 8) and in a batch of 8
requests' verifies; the ops agree with the torch formulas they replace to rounding; and the avx2 build gives the
avx512 build's bits (so capping the ISA here stands in for an AVX2-only CPU). The path is in each test id.

Real shapes (out, in): SmolLM2-135M (hidden 576, MLP 1536, vocab 49152, 9/3 heads of 64) and Qwen2.5 1.5B / 0.5B
(1536 / 896 hidden, MLP 8960 / 4864, vocab 151936 is only sliced here: 4096 rows of it, the same K)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runtime import cpu_kernels
from model_runtime import kernel_registry as registry
from model_runtime.attention import paged_attention, plan_attention
from tests.model_runtime.test_attention import causal_mask

PORTABLE = [p.name for p in registry.PATHS if registry.LINEAR in p.ops and registry.cpu_has(p.name)]
# the paths a forward can take (q4-only paths aside: test_quant_kernels.py)
PATHS = [p.name for p in registry.PATHS
         if {registry.LINEAR, registry.PACKED_LINEAR} & set(p.ops) and registry.cpu_has(p.name)]
WIDE = 512  # attention widths on both sides of it (the AMX build's own attention once stopped there)
LINEAR_SHAPES = [(576 * 3 // 1, 576), (1536 * 2, 576), (576, 1536), (4096, 576),  # SmolLM2 (qkv ~, gate_up, down)
                 (2048, 1536), (17920, 1536), (1536, 8960), (4096, 1536),  # Qwen 1.5B (qkv, gate_up, down, lm_head)
                 (9728, 896), (896, 4864), (37, 19)]  # Qwen 0.5B, an odd one (tails)
ROW_COUNTS = (1, 9, 72, 200)  # decode; k = 8 verify; 8 requests x (k + 1); a prefill past the linear's L2 row chunk


def portable(path: str) -> object:
    """The path's own build of the portable kernels (None where it does not load)."""
    return registry.module(registry.build_of(path, registry.LINEAR))


def rows_module(path: str, dtype: torch.dtype) -> object:
    """The module a model of `dtype` runs its row ops on under `path` (one for both dtypes: the registry's)."""
    found = registry.resolve(registry.RMS_NORM, path)
    assert found is not None, path
    return found[1]


def needs(path: str) -> None:
    """Skip where the path's defining build does not load here (with its reason)."""
    build = registry.BY_NAME[path].builds[0]
    if registry.module(build) is None:
        pytest.skip(f"{build.name}: {registry.status(build)}")


def assert_rows_invariant(op, x: torch.Tensor) -> None:  # noqa: ANN001
    """op(x)'s row i equals op on row i alone, and on the rows in every slice of 9 (verify-sized calls)."""
    together = op(x)
    for i in {0, 1, x.shape[0] // 2, x.shape[0] - 1}:
        assert torch.equal(op(x[i:i + 1]), together[i:i + 1]), i
    for s in range(0, x.shape[0], 9):
        assert torch.equal(op(x[s:s + 9]), together[s:s + 9]), s


@pytest.mark.parametrize("path", PORTABLE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("n", "k"), LINEAR_SHAPES, ids=[f"{n}x{k}" for n, k in LINEAR_SHAPES])
def test_linear_rows_are_batch_invariant_and_near_the_exact_product(path: str, dtype: torch.dtype, n: int,
                                                                     k: int) -> None:
    needs(path)
    module = portable(path)
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(max(ROW_COUNTS), k, generator=g).to(dtype)
    for b in (None, bias):
        assert_rows_invariant(lambda rows, b=b: module.linear(rows, w, b, False), x)
    exact = x.double() @ w.double().T + bias.double()
    ours = module.linear(x, w, bias, False).double()
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -22  # one rounding of the output, plus the sums'
    assert ((ours - exact).abs() <= exact.abs() * rounding + k * 2.0 ** -24 * 4).all()
    logits = module.linear(x, w, None, True)  # float32 straight from the accumulators (the lm_head)
    assert logits.dtype == torch.float32
    assert_rows_invariant(lambda rows: module.linear(rows, w, None, True), x)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width", [576, 896, 1536, 37])
def test_norm_and_activation_rows_are_batch_invariant_and_match_torch(path: str, dtype: torch.dtype,
                                                                        width: int) -> None:
    needs(path)
    module = rows_module(path, dtype)
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(72, width, generator=g) * 3).to(dtype)
    weight = torch.randn(width, generator=g).to(dtype)
    gate_up = (torch.randn(72, 2 * width * 3, generator=g) * 4).to(dtype)  # MLP widths: 3x the hidden
    assert_rows_invariant(lambda rows: module.rms_norm(rows, weight, 1e-6), x)
    assert_rows_invariant(module.silu_mul, gate_up)
    x32 = x.float()
    ref_norm = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    ref_act = F.silu(gate) * up
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20  # bf16: one rounding; fp32: the sums' order, exp
    for ours, ref in ((module.rms_norm(x, weight, 1e-6), ref_norm), (module.silu_mul(gate_up), ref_act)):
        assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * ulp + 1e-30).all()


def attention_case(dtype: torch.dtype, heads: int, kv_heads: int, d: int, shapes: list[tuple[int, int]], seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    g = torch.Generator().manual_seed(seed)
    total = sum(p + n for p, n in shapes)
    k = torch.randn(total + 5, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(total + 5, kv_heads, d, generator=g).to(dtype)
    slots = torch.randperm(total + 5, generator=g)
    seqs, start, offset = [], 0, 0
    for past, n in shapes:
        seqs.append((offset, slots[start:start + past + n], causal_mask(past, n)))
        start, offset = start + past + n, offset + n
    q = torch.randn(offset, heads, d, generator=g).to(dtype)
    return q, k, v, seqs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (12, 2, 128), (14, 2, 64)],
                         ids=["smollm2", "qwen1.5b", "qwen0.5b"])
def test_attention_rows_alone_equal_rows_among_others(path: str, dtype: torch.dtype, heads: int, kv_heads: int,
                                                      d: int) -> None:
    """Decodes, k=8 verifies and a prefill in one batch, at widths below and above WIDE; each row equals that
    token decoded alone (one row, its own prefix)."""
    needs(path)
    module = rows_module(path, dtype)
    shapes = [(40, 1), (100, 9), (10, 9), (0, 30), (WIDE - 3, 9), (WIDE + 70, 9), (700, 1)]
    q, k, v, seqs = attention_case(dtype, heads, kv_heads, d, shapes, heads + d)
    together = paged_attention(q, k, v, plan_attention(seqs), rows=module)
    for (offset, slots, _mask), (past, n) in zip(seqs, shapes, strict=True):
        for i in range(n):
            one = plan_attention([(0, slots[:past + i + 1], torch.ones(1, past + i + 1, dtype=torch.bool))])
            alone = paged_attention(q[offset + i:offset + i + 1], k, v, one, rows=module)
            assert torch.equal(alone[0], together[offset + i]), (past, n, i)
    with torch.no_grad():  # and near the float64 products
        ref = paged_attention(q.double(), k.double(), v.double(), plan_attention(seqs), rows=None)
    assert ((together.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + 2e-3).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (12, 2, 128)], ids=["smollm2", "qwen1.5b"])
def test_a_tree_row_equals_the_chain_of_its_ancestors(path: str, heads: int, kv_heads: int, d: int) -> None:
    needs(path)
    module = rows_module(path, torch.bfloat16)
    past = 30
    g = torch.Generator().manual_seed(9)
    k = torch.randn(past + 3, kv_heads, d, generator=g).bfloat16()
    v = torch.randn(past + 3, kv_heads, d, generator=g).bfloat16()
    slots = torch.arange(past + 3)
    q = torch.randn(3, heads, d, generator=g).bfloat16()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2 is node 1's sibling
    mask = torch.cat([torch.ones(3, past, dtype=torch.bool), tree], dim=1)
    out = paged_attention(q, k, v, plan_attention([(0, slots, mask)]), rows=module)
    chain = torch.cat([slots[:past + 1], slots[past + 2:]])
    alone = paged_attention(q[2:], k, v, plan_attention([(0, chain, torch.ones(1, past + 2, dtype=torch.bool))]),
                            rows=module)
    assert torch.equal(out[2], alone[0])


@pytest.mark.skipif(len(PORTABLE) < 2, reason="this CPU runs one portable build only")
def test_the_avx2_build_gives_the_avx512_builds_bits() -> None:
    wide, narrow = portable("avx512"), portable("avx2")
    if wide is None or narrow is None:
        pytest.skip("a portable build did not load")
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        x, w = torch.randn(9, 1536, generator=g).to(dtype), torch.randn(700, 1536, generator=g).to(dtype)
        assert torch.equal(wide.linear(x, w, None, False), narrow.linear(x, w, None, False))
        assert torch.equal(wide.rms_norm(x, w[0], 1e-6), narrow.rms_norm(x, w[0], 1e-6))
        assert torch.equal(wide.silu_mul(x), narrow.silu_mul(x))
        q, k, v, seqs = attention_case(dtype, 9, 3, 64, [(600, 9), (3, 1)], 5)
        groups = plan_attention(seqs)
        assert torch.equal(paged_attention(q, k, v, groups, rows=wide), paged_attention(q, k, v, groups, rows=narrow))


def test_the_switch_names_a_path_or_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "avx1024")
    with pytest.raises(ValueError, match="choose one of"):
        cpu_kernels.active()
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "onednn")  # the old name of the libraries' path
    assert cpu_kernels.active() == "torch"
    assert not cpu_kernels.for_dtype(torch.bfloat16).exact
    for path in PATHS:
        monkeypatch.setenv("SPECSERVE_CPU_KERNEL", path)
        if registry.module(registry.BY_NAME[path].builds[0]) is not None:
            assert cpu_kernels.active() == path and cpu_kernels.for_dtype(torch.bfloat16).exact
    if not registry.cpu_has("amx"):
        monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "amx")
        with pytest.raises(ValueError, match="cannot run it"):
            cpu_kernels.active()
