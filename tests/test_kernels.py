"""The fused CPU kernels (pagedserve/kernels) against the torch code they replace, op by op.
Whole-model checks (kernels on = kernels off = transformers) are in test_hf_equivalence.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import kernels
from pagedserve.attention.metadata import build_group

NATIVE = kernels.load()
# CI has g++ and ninja: the kernels must build there, so a silent fallback cannot hide a bug.
pytestmark = pytest.mark.skipif(NATIVE is None and kernels.os.environ.get(kernels.ENV) == "0",
                                reason="PAGEDSERVE_CPU_KERNELS=0")


@pytest.fixture(scope="module",
                params=["native", pytest.param("portable", marks=pytest.mark.slow)])
def ops(request):
    """The kernels as the engine loads them (AVX-512 or AVX2, as this CPU has), and built
    without AVX-512 and AVX2, so the portable branches of the SIMD type (kernels/vec.h) are
    tested too."""
    if request.param == "native":
        return NATIVE
    flags = ("-mno-avx512f", "-mno-avx2")
    return kernels.build(kernels._build_name(flags), "pagedserve_portable", flags)


def test_kernels_build():
    assert NATIVE is not None, "the CPU kernels did not build (see the log)"


def test_build_name_changes_with_source_and_flags(monkeypatch, tmp_path):
    """The compiled-kernel cache is keyed by the source and the flags: another checkout's
    source (or another flag set) never loads or overwrites this one's binary."""
    name = kernels._build_name()
    assert kernels._build_name() == name
    assert kernels._build_name(("-mno-avx512f",)) != name
    other = tmp_path / "linear.cpp"
    other.write_text(kernels.SOURCES[3].read_text() + "\n// another version\n")
    monkeypatch.setattr(kernels, "SOURCES", [*kernels.SOURCES[:3], other, kernels.SOURCES[4]])
    assert kernels._build_name() != name


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("y_dtype", [None, torch.float32, torch.bfloat16])
def test_add_rms_norm(ops, out_dtype, y_dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 576) * 3
    w = torch.rand(576) + 0.5
    y = None if y_dtype is None else torch.randn(5, 576).to(y_dtype)
    expect_res = x if y is None else x + y.float()
    expect = F.rms_norm(expect_res, (576,), w, 1e-5).to(out_dtype)
    res = x.clone()
    out = ops.add_rms_norm(res, y, w, 1e-5, out_dtype)
    assert out.dtype == out_dtype
    torch.testing.assert_close(res, expect_res)  # updated in place
    torch.testing.assert_close(out, expect, rtol=1e-5 if out_dtype == torch.float32 else 1e-2,
                               atol=1e-5 if out_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32),
                                    (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
def test_silu_and_mul(ops, dtypes):
    in_dtype, out_dtype = dtypes
    x = (torch.randn(7, 2 * 96) * 4).to(in_dtype)
    gate, up = x.float().chunk(2, -1)
    out = ops.silu_and_mul(x, out_dtype)
    torch.testing.assert_close(out, (F.silu(gate) * up).to(out_dtype), rtol=1e-5, atol=1e-5)


def _cache(num_blocks=12, block_size=4, kv_heads=2, head_dim=16, dtype=torch.float32):
    torch.manual_seed(1)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv(ops, in_dtype):
    heads, kv_heads, d, t = 6, 2, 16, 5
    k_cache, v_cache = _cache(kv_heads=kv_heads, head_dim=d)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(in_dtype)
    angles = torch.rand(t, d // 2) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    slots = torch.tensor([3, 17, 0, 44, 20])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    x = qkv.float().view(t, heads + 2 * kv_heads, d)
    rot = x * cos[:, None] + x.roll(d // 2, dims=-1) * sin[:, None]
    expect_k.view(-1, kv_heads, d)[slots] = rot[:, heads:heads + kv_heads]
    expect_v.view(-1, kv_heads, d)[slots] = x[:, heads + kv_heads:]
    q = ops.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads,
                            torch.float32)
    torch.testing.assert_close(q, rot[:, :heads])
    torch.testing.assert_close(k_cache, expect_k)
    torch.testing.assert_close(v_cache, expect_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slots + 100, heads, kv_heads,
                            torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [8, 16, 64, 160])
@pytest.mark.parametrize("copies", [1, 4])
def test_paged_decode_attention_matches_dense(ops, cache_dtype, d, copies):
    """Against the gather + masked SDPA of attention/paged.py's torch path, on scattered blocks
    of different lengths (one ending mid-block, one a single token). head_dim 16 and 64 take
    the register-accumulated value pass, 8 and 160 the plain one; 3 sequences are split per KV
    head over the threads, 12 are whole items. Sliding windows of 1 to 64 keys start
    mid-block."""
    heads, kv_heads, bs = 6, 2, 4
    k_cache, v_cache = _cache(num_blocks=12, block_size=bs, kv_heads=kv_heads, head_dim=d,
                              dtype=cache_dtype)
    tables = [[7, 2, 9], [4], [11, 0, 5, 3, 1]] * copies
    seq_lens = [10, 1, 20] * copies
    b = len(seq_lens)
    g = build_group([1] * b, seq_lens, [tables], bs, heads // kv_heads, torch.device("cpu"))
    q = torch.randn(b, heads, d)
    k = k_cache.float()[g.block_ids[0]].view(b, -1, kv_heads, d).transpose(1, 2)
    v = v_cache.float()[g.block_ids[0]].view(b, -1, kv_heads, d).transpose(1, 2)
    expect = F.scaled_dot_product_attention(q.view(b, kv_heads, heads // kv_heads, d), k, v,
                                            attn_mask=g.mask, scale=0.25).reshape(b, heads, d)
    out = ops.paged_decode_attention(q, k_cache, v_cache, g.block_ids[0].view(b, -1), g.seq_lens,
                                     0.25, torch.float32)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    for window in (1, 3, 6, 64):  # a sliding window: the last `window` keys (mid-block starts)
        expect = F.scaled_dot_product_attention(
            q.view(b, kv_heads, heads // kv_heads, d), k, v, attn_mask=g.window_mask(window),
            scale=0.25).reshape(b, heads, d)
        out = ops.paged_decode_attention(q, k_cache, v_cache, g.block_ids[0].view(b, -1),
                                         g.seq_lens, 0.25, torch.float32, window)
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="seq_len outside"):
        ops.paged_decode_attention(q, k_cache, v_cache, g.block_ids[0].view(b, -1),
                                   g.seq_lens + 20, 0.25, torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_long_contexts_match_dense(ops, cache_dtype):
    """Contexts of several 256-key chunks (and one just past a chunk, one inside a tile),
    SmolLM2's head counts, blocks in random order: the walk over chunks and tiles and the
    prefetch running ahead from K's rows into V's, whole items and items split per KV head,
    with and without a sliding window."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    seq_lens = [600, 257, 3, 1000, 16, 259]
    nb = [-(-n // bs) for n in seq_lens]
    k_cache, v_cache = _cache(num_blocks=sum(nb) + 5, block_size=bs, kv_heads=kv_heads,
                              head_dim=d, dtype=cache_dtype)
    order = torch.randperm(sum(nb) + 5, generator=torch.Generator().manual_seed(3)).tolist()
    tables, at = [], 0
    for n in nb:
        tables.append(order[at:at + n])
        at += n
    for b in (len(seq_lens), 2):  # whole items; split per KV head
        g = build_group([1] * b, seq_lens[:b], [tables[:b]], bs, heads // kv_heads,
                        torch.device("cpu"))
        q = torch.randn(b, heads, d)
        k = k_cache.float()[g.block_ids[0]].view(b, -1, kv_heads, d).transpose(1, 2)
        v = v_cache.float()[g.block_ids[0]].view(b, -1, kv_heads, d).transpose(1, 2)
        for window, mask in ((0, g.mask), (300, g.window_mask(300))):
            expect = F.scaled_dot_product_attention(
                q.view(b, kv_heads, heads // kv_heads, d), k, v, attn_mask=mask,
                scale=0.125).reshape(b, heads, d)
            out = ops.paged_decode_attention(q, k_cache, v_cache, g.block_ids[0].view(b, -1),
                                             g.seq_lens, 0.125, torch.float32, window)
            torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_refuses_degenerate_shapes(ops):
    """0 KV heads (a division by zero, SIGFPE) and head_dim 0 (a read past every row, SIGSEGV)
    crashed the process before; a 5-D cache and [B, 1] lengths were taken as something else."""
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([5])
    cases = [(torch.randn(1, 4, 64), torch.randn(2, 4, 0, 64), tables, lens, "KVH > 0"),
             (torch.randn(1, 4, 0), torch.randn(2, 4, 2, 0), tables, lens, "D > 0"),
             (torch.randn(1, 4, 64), torch.randn(2, 4, 2, 64, 2), tables, lens, "k_cache must"),
             (torch.randn(1, 4, 64), torch.randn(2, 4, 2, 64), tables, lens[:, None], "seq_lens")]
    for q, cache, t, n, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.paged_decode_attention(q, cache, cache.clone(), t, n, 0.1, torch.float32)


def _prefill_reference(q, k_cache, v_cache, tables, seq_lens, query_lens, scale, window=0):
    """Each query row against its own keys (positions 0 .. its own, or the last ``window``),
    one softmax per row in float64."""
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    kv_heads, d = k_cache.shape[2:]
    group = q.shape[1] // kv_heads
    for table, n, s in zip(tables, query_lens, seq_lens):
        k = k_cache.double()[table].reshape(-1, kv_heads, d)[:s].repeat_interleave(group, 1)
        v = v_cache.double()[table].reshape(-1, kv_heads, d)[:s].repeat_interleave(group, 1)
        for pos in range(s - n, s):
            lo = max(0, pos + 1 - window) if window else 0
            w = torch.einsum("hd,thd->ht", q[row].double(), k[lo:pos + 1]) * scale
            out[row] = torch.einsum("ht,thd->hd", w.softmax(-1), v[lo:pos + 1])
            row += 1
    return out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 16), (9, 3, 64), (4, 1, 256), (16, 1, 8),
                                              (8, 8, 160)])
def test_paged_prefill_attention_matches_dense(ops, cache_dtype, heads, kv_heads, d):
    """Chunks over cached context, a whole prompt, a one-row chunk and a chunk ending mid-block,
    on scattered blocks; sliding windows of 1 to 64 keys. G = 1 .. 16 query heads per KV head
    (tiles of 12 / G positions, a G of 16 split in two), head_dim 8 .. 256."""
    bs = 4
    k_cache, v_cache = _cache(num_blocks=24, block_size=bs, kv_heads=kv_heads, head_dim=d,
                              dtype=cache_dtype)
    tables = [[7, 2, 9], [4, 13], [11, 0, 5, 3, 1, 20, 21, 22, 23], [14, 15, 16, 17, 18, 19]]
    seq_lens, query_lens = [10, 5, 35, 21], [6, 1, 35, 13]
    g = build_group(query_lens, seq_lens, [tables], bs, heads // kv_heads, torch.device("cpu"))
    q, scale = torch.randn(sum(query_lens), heads, d), d ** -0.5
    for window in (0, 1, 3, 6, 64):
        expect = _prefill_reference(q, k_cache, v_cache, tables, seq_lens, query_lens, scale,
                                    window)
        out = ops.paged_prefill_attention(q, k_cache, v_cache, g.block_ids[0].view(4, -1),
                                          g.seq_lens, g.query_lens, scale, torch.float32,
                                          window)
        torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)
    out = ops.paged_prefill_attention(q.bfloat16(), k_cache, v_cache, g.block_ids[0].view(4, -1),
                                      g.seq_lens, g.query_lens, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _prefill_reference(
        q.bfloat16(), k_cache, v_cache, tables, seq_lens, query_lens, scale), rtol=2e-2,
        atol=2e-2)


@pytest.mark.parametrize("window", [0, 5, 23])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention_rows_do_not_depend_on_the_chunking(ops, window, cache_dtype):
    """A prompt of 45 rows in one call, in two chunks at each cut, and beside other requests
    gives bit-identical rows: the bfloat16 prompt matmuls round whatever attention returns, so
    a 1e-6 difference between chunkings would become a different answer."""
    heads, kv_heads, d, bs = 9, 3, 64, 4
    k_cache, v_cache = _cache(num_blocks=16, block_size=bs, kv_heads=kv_heads, head_dim=d,
                              dtype=cache_dtype)
    table = torch.tensor([[12, 3, 7, 0, 9, 1, 15, 2, 4, 8, 5, 6]])
    q = torch.randn(45, heads, d)

    def run(rows, first, others=0):
        n = rows.shape[0]
        lens = torch.tensor([first + n] + [7] * others)
        qlens = torch.tensor([n] + [3] * others)
        tables = torch.cat([table, torch.tensor([[10, 11] + [0] * 10] * others,
                                                dtype=torch.int64).view(-1, 12)])
        q_all = torch.cat([rows, torch.randn(3 * others, heads, d)])
        return ops.paged_prefill_attention(q_all, k_cache, v_cache, tables, lens, qlens, 0.125,
                                           torch.float32, window)[:n]

    whole = run(q, 0)
    for cut in (1, 12, 16, 17, 31, 44):
        assert torch.equal(torch.cat([run(q[:cut], 0), run(q[cut:], cut)]), whole), cut
    assert torch.equal(torch.cat([run(q[:20], 0, 3), run(q[20:], 20, 5)]), whole)


def test_paged_prefill_attention_refuses_bad_lengths(ops):
    k_cache, v_cache = _cache(num_blocks=4, block_size=4, kv_heads=2, head_dim=16)
    q, tables = torch.randn(5, 4, 16), torch.tensor([[0, 1]])
    cases = [(torch.tensor([5]), torch.tensor([4]), "sum to q's rows"),
             (torch.tensor([9]), torch.tensor([5]), "outside its block table"),
             (torch.tensor([4]), torch.tensor([5]), "outside its block table"),
             (torch.tensor([5]), torch.tensor([5.0]), "int64")]
    for lens, qlens, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.paged_prefill_attention(q, k_cache, v_cache, tables, lens, qlens, 0.1,
                                        torch.float32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables + 3, torch.tensor([5]),
                                    torch.tensor([5]), 0.1, torch.float32)


def test_argmax_matches_torch(ops):
    torch.manual_seed(2)
    x = torch.randn(9, 1000)
    x[1, 7] = x[1, 900] = 50.0  # a tie: the first index
    x[2, :] = -1e30
    x[3, 5] = float("nan")  # a NaN wins (torch's rule), before or after the max
    x[3, 600] = 99.0
    x[4, 999] = float("nan")
    x[5, 999] = 1e9  # the tail after the last full chunk
    x[6, :] = float("-inf")
    torch.testing.assert_close(ops.argmax(x), x.argmax(-1))
    y = torch.randn(4, 5)  # narrower than one chunk
    assert ops.argmax(y).tolist() == y.argmax(-1).tolist()


@pytest.mark.parametrize("rows", [1, 3, 9, 17])
def test_int8_linear_matches_dequantized_float(ops, rows):
    """Q8_0-layout weights (int8, one scale per 32 columns) against F.linear of the same
    weights dequantized; rows past 8 take a second pass of the register tile."""
    from pagedserve.model.quant import quantize_q8_0

    torch.manual_seed(3)
    w = torch.randn(200, 96)
    q, scales = quantize_q8_0(w)
    dense = (q.view(200, 3, 32).float() * scales[..., None]).view(200, 96)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(ops.int8_linear(x, q, scales), F.linear(x, dense),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="divisible by 32"):
        ops.int8_linear(torch.randn(1, 40), torch.zeros(2, 40, dtype=torch.int8),
                        torch.ones(2))


def _q16_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int16 codes as float [M, K / 32, 32], scales [M, K / 32]): int4_linear's
    activation rule, round(x * 32767 / max |x|) per group of 32."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
    return (g * inv[..., None]).round().clamp(-32767, 32767), amax / 32767


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 12])
def test_int4_linear_matches_its_integer_reference(ops, rows):
    """Int4Linear's groups (codes two a byte, a bfloat16 scale and zero per 32 columns) times
    x quantized to int16 per group of 32, against the same arithmetic in torch (float64),
    and within 1e-4 of F.linear with the weights dequantized in float32; 17 groups a row (no whole number
    of vectors), rows past 4 in a second pass of the register tile, a zero group of x."""
    from pagedserve.model.quant import Int4Linear

    torch.manual_seed(5)
    layer = Int4Linear.from_weight(torch.randn(70, 544), dense_dtype=torch.float32, ops=ops)
    assert layer.codes.shape == (70, 272) and layer.scale_zero.shape == (70, 17, 2)
    b = layer.codes.view(70, 17, 16)
    codes = torch.stack([b & 15, b >> 4], 2).view(70, 17, 32).float()
    scale, zero = layer.scale_zero[..., 0].float(), layer.scale_zero[..., 1].float()
    x = torch.randn(rows, 544)
    x[0, 32:64] = 0
    xq, xs = _q16_groups(x)
    # [rows, 70]: sum over groups of scale * xs * (codes - 8) . xq + zero * sum x
    expect = (torch.einsum("ngk,mgk->mng", (codes - 8).double(), xq.double())
              * scale.double() * xs[:, None, :].double()
              + zero.double() * x.view(rows, 1, 17, 32).sum(-1).double()).sum(-1).float()
    got = ops.int4_linear(x, layer.codes, layer.scale_zero)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-3)  # float32 sums of ~1e3
    weight = ((codes - 8) * scale[..., None] + zero[..., None]).view(70, 544)
    exact = F.linear(x, weight)
    assert (got - exact).norm() < 1e-4 * exact.norm()  # x's rounding: ~2^-16
    # bfloat16 in: the same product of the same values, returned rounded to bfloat16 (how
    # Int4Linear calls it, for float32 callers too)
    xb = x.bfloat16()
    from_bf16 = ops.int4_linear(xb, layer.codes, layer.scale_zero)
    assert from_bf16.dtype == torch.bfloat16
    assert torch.equal(from_bf16, ops.int4_linear(xb.float(), layer.codes,
                                                  layer.scale_zero).bfloat16())
    assert torch.equal(layer(x), from_bf16.float())
    assert torch.equal(layer(xb), from_bf16)
    with pytest.raises(RuntimeError, match="divisible by 32"):
        ops.int4_linear(torch.randn(1, 40), torch.zeros(2, 20, dtype=torch.uint8),
                        torch.ones(2, 1, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="scale_zero"):
        ops.int4_linear(x, layer.codes, layer.scale_zero.float())


@pytest.mark.parametrize("shape", [(1, 96, 48), (3, 96, 100), (9, 40, 7), (17, 64, 145),
                                   (600, 576, 50), (72, 11008, 96), (3865, 1536, 48),
                                   (0, 96, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(ops, shape, bias):
    """Panels of 48 columns (the last one padded: n = 7, 100, 145), rows in tiles of 8 with a
    remainder, and x over 1 MB in row blocks: 600 x 576 in two; 72 x 11008 and 3865 x 1536,
    where rounding the block to whole tiles leaves fewer blocks than asked for (an empty last
    block divided by zero, SIGFPE, before)."""
    from pagedserve.model.linear import pack_linear_weight

    m, k, n = shape
    torch.manual_seed(4)
    w, x = torch.randn(n, k), torch.randn(m, k)
    b = torch.randn(n) if bias else None
    packed = pack_linear_weight(w)
    assert packed.shape == (-(-n // 48), k, 48)
    assert torch.equal(packed.transpose(1, 2).reshape(-1, k)[:n], w)  # column j of panel p: row 48 p + j
    expect = F.linear(x, w, b)
    tol = dict(rtol=1e-4, atol=1e-5 * k ** 0.5)  # sums of k terms of size ~1: ~sqrt(k)
    torch.testing.assert_close(ops.packed_linear(x, packed, b, n), expect, **tol)
    buffer = torch.full((m * n + 5,), float("nan"))
    out = ops.packed_linear(x, packed, b, n, buffer)  # written into the caller's buffer
    torch.testing.assert_close(out, expect, **tol)
    assert m == 0 or out.data_ptr() == buffer.data_ptr()


@pytest.mark.parametrize("shape", [(1, 96, 24), (9, 40, 7), (17, 64, 100), (64, 576, 1536),
                                   (600, 576, 30), (0, 32, 24)])
def test_gated_packed_linear_is_swiglu(ops, shape):
    """gated=True: silu(x @ gate.T) * (x @ up.T) from the tile's epilogue, 24 gate and 24 up
    columns per panel (the last one padded: I = 7, 100, 30); bit for bit the unfused
    packed_linear + silu_and_mul, and close to torch's SwiGLU."""
    from pagedserve.model.linear import pack_gated_weight, pack_linear_weight

    m, k, inter = shape
    torch.manual_seed(5)
    w, x = torch.randn(2 * inter, k), torch.randn(m, k)
    packed = pack_gated_weight(w)
    assert packed.shape == (-(-inter // 24), k, 48) and packed.is_contiguous()
    halves = packed.view(-1, k, 2, 24).permute(2, 0, 3, 1).reshape(2, -1, k)  # 24 gate | 24 up
    assert torch.equal(halves[:, :inter].reshape(2 * inter, k), w)
    out = ops.packed_linear(x, packed, None, inter, None, True)
    unfused = ops.silu_and_mul(ops.packed_linear(x, pack_linear_weight(w), None, 2 * inter),
                               torch.float32)
    assert torch.equal(out, unfused)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-4, atol=1e-4 * k ** 0.5)
    with pytest.raises(RuntimeError, match="gated panels"):
        ops.packed_linear(x, packed, None, packed.shape[0] * 24 + 1, None, True)
    with pytest.raises(RuntimeError, match="no bias"):
        ops.packed_linear(x, packed, torch.zeros(inter), inter, None, True)


@pytest.mark.parametrize("shape", [(1, 96, 48), (3, 96, 100), (9, 40, 7), (17, 64, 145),
                                   (600, 576, 50), (3865, 1536, 48), (0, 96, 48)])
def test_packed_linear_bf16_matches_a_float_product(ops, shape):
    """bfloat16 x @ W.T over W packed in panels of pairs: float32 accumulation of the exact
    bf16 x bf16 products (close to a float64 product), a bfloat16 result that is the float32
    one rounded, and each row's result the same whatever rows share the call (tiles of 8 and
    row blocks over 1 MB: 3865 x 1536)."""
    from pagedserve.model.linear import pack_bf16_weight

    m, k, n = shape
    torch.manual_seed(6)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    packed = pack_bf16_weight(w.float())
    assert packed.shape == (-(-n // 48), k // 2, 48, 2) and packed.dtype == torch.bfloat16
    assert torch.equal(packed.transpose(1, 2).reshape(-1, k)[:n], w)  # pairs of row 48 p + j
    out = ops.packed_linear_bf16(x, packed, n, torch.float32)
    expect = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-5 * k ** 0.5)
    assert torch.equal(ops.packed_linear_bf16(x, packed, n, torch.bfloat16), out.bfloat16())
    buffer = torch.full((m * n + 5,), float("nan"))
    into = ops.packed_linear_bf16(x, packed, n, torch.float32, buffer)  # the caller's buffer
    assert torch.equal(into, out) and (m == 0 or into.data_ptr() == buffer.data_ptr())
    if m > 9:
        assert torch.equal(ops.packed_linear_bf16(x[5:9], packed, n, torch.float32), out[5:9])
        assert torch.equal(ops.packed_linear_bf16(x[m - 1:], packed, n, torch.float32), out[m - 1:])


def test_packed_linear_bf16_refuses_bad_shapes(ops):
    from pagedserve.model.linear import pack_bf16_weight

    packed = pack_bf16_weight(torch.randn(100, 32))
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.packed_linear_bf16(x, packed, 200, torch.float32)
    with pytest.raises(RuntimeError, match="with x's K"):
        ops.packed_linear_bf16(torch.randn(2, 34).bfloat16(), packed, 100, torch.float32)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        ops.packed_linear_bf16(x.float(), packed, 100, torch.float32)
    with pytest.raises(RuntimeError, match="out_dtype must be"):
        ops.packed_linear_bf16(x, packed, 100, torch.float16)
    with pytest.raises(RuntimeError, match="out_buffer"):
        ops.packed_linear_bf16(x, packed, 100, torch.float32, torch.empty(199))
    with pytest.raises(ValueError, match="even number"):
        pack_bf16_weight(torch.randn(4, 33))


def test_packed_linear_refuses_bad_shapes(ops):
    from pagedserve.model.linear import pack_linear_weight

    packed = pack_linear_weight(torch.randn(100, 32))
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.packed_linear(torch.randn(2, 32), packed, None, 200)
    with pytest.raises(RuntimeError, match="with x's K"):
        ops.packed_linear(torch.randn(2, 31), packed, None, 100)
    with pytest.raises(RuntimeError, match="bias"):
        ops.packed_linear(torch.randn(2, 32), packed, torch.randn(99), 100)
    with pytest.raises(RuntimeError, match="out_buffer"):
        ops.packed_linear(torch.randn(2, 32), packed, None, 100, torch.empty(199))


def test_a_stale_build_lock_is_removed():
    """A build killed by SIGTERM leaves torch's lock file, on which every later build would wait
    forever; one older than STALE_LOCK_SECONDS is removed before building."""
    import os
    import time

    from torch.utils import cpp_extension

    name = kernels._build_name()
    lock = os.path.join(cpp_extension._get_build_directory(name, verbose=False), "lock")
    open(lock, "w").close()
    old = time.time() - kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert kernels.build(name) is not None
    assert not os.path.exists(lock)


def test_no_compiler_falls_back_with_one_reason(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        kernels.build("pagedserve_never_built")
    kernels._compiled.cache_clear()
    try:
        assert kernels.load() is None
        assert "no C++ compiler" in caplog.text and "running the torch path" in caplog.text
    finally:
        kernels._compiled.cache_clear()


@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_rotary_write_kv_quant_matches_torch(ops, name):
    """The quantized cache's write: each token's rotated K and its V land in its sequence's
    open row; a token that completes a block has the block quantized exactly as kv/quant.py
    quantizes the same rows (the same bytes). Three sequences: a decode that fills its block,
    a decode mid-block, and a prefill chunk over three blocks starting mid-block."""
    from pagedserve.attention.paged import KERNEL_KIND
    from pagedserve.kv.quant import PARAM_DTYPE, quantize_blocks, quantize_rows

    torch.manual_seed(4)
    heads, kvh, d, bs, nblocks = 6, 2, 32, 4, 10
    cd = d // 2 if name == "int4" else d
    k_codes = torch.zeros(nblocks, bs, kvh, cd, dtype=torch.int8 if name == "int8" else torch.uint8)
    v_codes = torch.zeros_like(k_codes)
    k_scale, k_zero = (torch.zeros(nblocks, kvh, d, dtype=PARAM_DTYPE) for _ in range(2))
    v_scale = torch.zeros(nblocks, bs, kvh, dtype=PARAM_DTYPE)
    k_open, v_open = torch.randn(4, bs, kvh, d), torch.randn(4, bs, kvh, d)
    before = k_open.clone(), v_open.clone()
    # (first position, tokens, open row, block table)
    seqs = [(7, 1, 2, [5, 1]), (1, 1, 0, [3]), (2, 9, 3, [8, 0, 6])]
    positions = [p for first, n, _, _ in seqs for p in range(first, first + n)]
    slots = torch.tensor([table[p // bs] * bs + p % bs for first, n, _, table in seqs
                          for p in range(first, first + n)])
    starts = torch.tensor([0, 1, 2, 11])
    rows = torch.tensor([r for _, _, r, _ in seqs])
    t = len(positions)
    qkv = torch.randn(t, (heads + 2 * kvh) * d)
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * torch.rand(d // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    k_out = torch.empty(t, kvh, d)
    q = ops.rotary_write_kv_quant(qkv, cos, sin, slots, starts, rows, k_open, v_open, k_codes,
                                  v_codes, k_scale, k_zero, v_scale, k_out, heads, kvh,
                                  KERNEL_KIND[name], torch.float32)
    x = qkv.view(t, heads + 2 * kvh, d)
    rot = x * cos[:, None] + x.roll(d // 2, dims=-1) * sin[:, None]
    torch.testing.assert_close(q, rot[:, :heads])
    torch.testing.assert_close(k_out, rot[:, heads:heads + kvh])
    v_new = x[:, heads + kvh:]
    tok = 0
    for first, n, r, table in seqs:
        k_rows = {p: before[0][r, p % bs] for p in range(first - first % bs, first)}
        v_rows = {p: before[1][r, p % bs] for p in range(first - first % bs, first)}
        for i in range(n):
            k_rows[first + i], v_rows[first + i] = k_out[tok + i], v_new[tok + i]
        tok += n
        for b in range(first // bs, (first + n) // bs):  # the blocks this step filled
            ks = torch.stack([k_rows[p] for p in range(b * bs, (b + 1) * bs)])
            vs = torch.stack([v_rows[p] for p in range(b * bs, (b + 1) * bs)])
            codes, scale, zero = quantize_blocks(ks[None], name)
            assert torch.equal(k_codes[table[b]], codes[0])
            assert torch.equal(k_scale[table[b]], scale[0])
            assert torch.equal(k_zero[table[b]], zero[0])
            codes, scale = quantize_rows(vs, name)
            assert torch.equal(v_codes[table[b]], codes)
            assert torch.equal(v_scale[table[b]], scale)
        last = (first + n - 1) // bs * bs  # the open row holds the last block's rows
        for p in range(last, first + n):
            assert torch.equal(k_open[r, p % bs], k_rows[p])
            assert torch.equal(v_open[r, p % bs], v_rows[p])
    assert torch.equal(k_open[1], before[0][1])  # an unused row is untouched
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rotary_write_kv_quant(qkv, cos, sin, slots + 100, starts, rows, k_open, v_open,
                                  k_codes, v_codes, k_scale, k_zero, v_scale, None, heads, kvh,
                                  KERNEL_KIND[name], torch.float32)


@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_paged_decode_attention_quant_matches_dense(ops, name):
    """Decode attention over quantized blocks and the open rows against dense attention on the
    values the cache holds (the harness of test_kv_quant.py), sliding windows included."""
    from test_kv_quant import run_case

    run_case(name, 4, 9, 3, [(1, 1), (4, 1), (5, 1), (37, 1), (64, 1), (30, 4)], head_dim=64,
             ops=ops)
    run_case(name, 16, 4, 2, [(1, 1), (17, 1), (100, 1), (33, 1)] * 5, head_dim=32, seed=1,
             ops=ops)
    for window in (1, 5, 20):
        run_case(name, 4, 4, 2, [(1, 1), (9, 1), (30, 1), (23, 3)], head_dim=32, seed=window,
                 ops=ops, window=window)
