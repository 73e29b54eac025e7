"""Quantized KV storage (kv/quant.py): round trips within the documented bounds, exact code
decoding, paged attention over the quantized cache (torch and the CPU kernel) against dense
attention on the values it holds, and end to end: prefix hits, swap, preemption, chunking and
forks give the tokens of a roomy run of the same mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import shared_prefix_workload

from pagedserve.attention.metadata import AttentionMetadata, build_group, build_open_blocks
from pagedserve.attention.paged import paged_attention, paged_attention_fused
from pagedserve.kv.cache import LayerKVCache
from pagedserve.kv.quant import (
    FP8,
    PARAM_DTYPE,
    QMAX,
    decode_codes,
    dequantize_blocks,
    dequantize_rows,
    fp8_to_bfloat16,
    quantize_blocks,
    quantize_rows,
    resolve_kv_cache_dtype,
)

MODES = ["int8", "fp8", "int4"]


def bound(x: torch.Tensor, name: str) -> torch.Tensor:
    """The documented per-element error bound (module docstring of kv/quant.py) for blocks
    x [blocks, block_size, heads, head_dim]."""
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    zero = ((lo + hi) / 2).to(PARAM_DTYPE).float()
    half = torch.maximum(hi - zero, zero - lo)
    if name == "int8":
        return half / 250 + 1e-30
    if name == "int4":
        return half / 13.8 + 1e-30
    return (x - zero).abs() / 16 + half / 400_000 + 1e-30


def cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for scale in (1e-6, 1e-2, 1.0, 30.0, 1e4, 1e30):
        out.append((f"normal x {scale:g}", torch.randn(8, 16, 3, 64, generator=g) * scale))
    outliers = torch.randn(8, 16, 3, 64, generator=g)
    outliers[..., 7] = outliers[..., 7] * 3 + 300  # an outlier channel with a common part
    outliers[5, 2, 1, 3] = -5e4
    out.append(("outliers", outliers))
    out.append(("all zero", torch.zeros(2, 16, 3, 64)))
    mixed = torch.randn(4, 16, 3, 64, generator=g)
    mixed[1] = 0  # an all-zero block
    mixed[2, :, 1] = 7.25  # a constant head
    mixed[3, :, 0, :] = 1e-38  # tiny (fp32 near its smallest normal)
    out.append(("zero blocks, constants and tiny", mixed))
    out.append(("uniform", torch.rand(4, 16, 3, 64, generator=g) * 2 - 1))
    out.append(("one token per block", torch.randn(6, 1, 2, 32, generator=g)))
    return out


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("case, x", cases(), ids=[c for c, _ in cases()])
def test_round_trip_within_the_bound(name, case, x):
    data, scale, zero = quantize_blocks(x, name)
    width = x.shape[-1] // 2 if name == "int4" else x.shape[-1]
    assert data.dtype == (torch.int8 if name == "int8" else torch.uint8)
    assert data.shape == (*x.shape[:-1], width)
    assert scale.shape == zero.shape == (x.shape[0], *x.shape[2:])
    assert scale.dtype == zero.dtype == torch.bfloat16 and bool((scale > 0).all())
    y = dequantize_blocks(data, scale, zero, name)
    assert torch.isfinite(y).all()
    err = (y - x).abs()
    assert bool((err <= bound(x, name)).all()), f"{case}: worst {(err / bound(x, name)).max()}"
    # an all-zero channel comes back as zeros
    zeros = (x.abs().amax(1) == 0)[:, None].expand_as(x)
    assert bool((y[zeros] == 0).all())
    # bfloat16 out: the same values up to bfloat16's rounding of the product and the sum
    yb = dequantize_blocks(data, scale, zero, name, dtype=torch.bfloat16).float()
    z = zero.float()[:, None]
    assert bool(((yb - y).abs() <= 2**-8 * ((y - z).abs() + y.abs()) + 1e-30).all())


@pytest.mark.parametrize("name", MODES)
def test_the_bound_is_tight_enough_to_matter(name):
    # the bound is not vacuous: the error of random values uses a good part of it
    x = torch.randn(64, 16, 3, 64, generator=torch.Generator().manual_seed(1))
    data, scale, zero = quantize_blocks(x, name)
    ratio = ((dequantize_blocks(data, scale, zero, name) - x).abs() / bound(x, name)).max()
    assert ratio > 0.5


@pytest.mark.parametrize("name", MODES)
def test_each_channel_reaches_its_top_code_without_clipping(name):
    x = torch.randn(8, 16, 2, 64, generator=torch.Generator().manual_seed(2))
    x[..., 5] *= 100  # an outlier channel keeps its own scale
    data, _, _ = quantize_blocks(x, name)
    codes = decode_codes(data, name).float()
    top = codes.abs().amax(dim=1)  # per block, head and channel
    qmax = QMAX[name]
    assert bool((top <= qmax).all()) and bool((top >= qmax * 0.9).all())


def test_a_block_is_quantized_from_its_own_values_only():
    x = torch.randn(10, 8, 3, 64, generator=torch.Generator().manual_seed(3))
    for name in MODES:
        whole = quantize_blocks(x, name)
        one = quantize_blocks(x[4:5], name)
        assert all(torch.equal(a[4:5], b) for a, b in zip(whole, one))


def test_fp8_decoding_equals_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = fp8_to_bfloat16(codes.clone())
    torchs = codes.view(FP8).to(torch.bfloat16)
    finite = ~torchs.isnan()  # 0x7f and 0xff are NaN in e4m3fn; quantize never writes them
    assert int(finite.sum()) == 254
    assert torch.equal(ours[finite], torchs[finite])
    assert bool(torch.isfinite(ours).all())


def test_int4_packs_two_channels_per_byte_low_nibble_first():
    x = torch.arange(-7, 9, dtype=torch.float32).clamp(max=7).view(1, 1, 1, 16)
    x = torch.cat([x, -x], 1)  # two tokens, so every channel spans a range
    data, scale, zero = quantize_blocks(x, "int4")
    assert data.shape == (1, 2, 1, 8)
    codes = decode_codes(data, "int4")
    assert torch.equal(codes[0, :, 0, 0::2], torch.stack([codes[0, 0, 0, 0::2],
                                                           codes[0, 1, 0, 0::2]]))
    assert torch.equal(data[0, 0, 0] & 15, (codes[0, 0, 0, 0::2] + 8).to(torch.uint8))
    assert torch.equal(data[0, 0, 0] >> 4, (codes[0, 0, 0, 1::2] + 8).to(torch.uint8))
    torch.testing.assert_close(dequantize_blocks(data, scale, zero, "int4"), x, atol=0.6,
                               rtol=0)


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int2'"):
        resolve_kv_cache_dtype("int2", torch.float32)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16).name == "bfloat16"
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32).storage_dtype == torch.uint8
    assert resolve_kv_cache_dtype("int4", torch.float32).code_dim(64) == 32


# ---- paged attention over a quantized cache ------------------------------------------------

def stored_block(x: torch.Tensor, name: str, values: bool) -> torch.Tensor:
    """What a full block x [block_size, heads, head_dim] of keys (or values) reads back as."""
    if values:
        return dequantize_rows(*quantize_rows(x, name), name)
    return dequantize_blocks(*quantize_blocks(x[None], name), name)[0]


def reference(q, k, v, n, block_size, name, scale, window=None):
    """Dense attention of the last n queries q [n, H, D] over k/v [ctx, Hkv, D]: each query
    reads the blocks before its own block as stored, its own block's rows unquantized (with a
    sliding ``window``, only its last ``window`` keys)."""
    ctx, hkv, _ = k.shape
    heads = q.shape[1]
    outs = []
    for i, p in enumerate(range(ctx - n, ctx)):
        own = p // block_size * block_size
        ks = [stored_block(k[b:b + block_size], name, False) for b in range(0, own, block_size)]
        vs = [stored_block(v[b:b + block_size], name, True) for b in range(0, own, block_size)]
        kk = torch.cat([*ks, k[own:p + 1]]).repeat_interleave(heads // hkv, 1).transpose(0, 1)
        vv = torch.cat([*vs, v[own:p + 1]]).repeat_interleave(heads // hkv, 1).transpose(0, 1)
        lo = 0 if window is None else max(0, p - window + 1)
        kk, vv = kk[:, lo:], vv[:, lo:]
        outs.append(F.scaled_dot_product_attention(q[i][:, None], kk, vv, scale=scale)[:, 0])
    return torch.stack(outs)


def run_case(name, block_size, num_heads, num_kv_heads, seqs, head_dim=32, seed=0, ops=None,
             window=None):
    """seqs: (context length including the new tokens, new tokens); cached context written
    as the cache holds it (full blocks quantized, the rest in the sequence's open row)."""
    g = torch.Generator().manual_seed(seed)
    spec = resolve_kv_cache_dtype(name, torch.float32)
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 3
    shape = (num_blocks, block_size, num_kv_heads, spec.code_dim(head_dim))
    # garbage everywhere (finite), so that a read of anything unwritten would show
    k, v = (torch.randint(0, 0x7F, shape, generator=g).to(spec.storage_dtype) for _ in range(2))
    params = [torch.rand(shape, generator=g).to(PARAM_DTYPE) for shape in (
        (num_blocks, num_kv_heads, head_dim), (num_blocks, num_kv_heads, head_dim),
        (num_blocks, block_size, num_kv_heads))]
    opened = [torch.randn(len(seqs) + 2, block_size, num_kv_heads, head_dim, generator=g)
              for _ in range(2)]
    cache = LayerKVCache(k, v, spec, 0, *params, *opened)
    free = torch.randperm(num_blocks, generator=g).tolist()
    rows = torch.randperm(len(seqs) + 2, generator=g).tolist()
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] > 1)  # decodes first
    tables, full, qs, open_row = {}, {}, {}, {}
    for i in order:
        ctx, n = seqs[i]
        tables[i] = [free.pop() for _ in range(-(-ctx // block_size))]
        open_row[i] = rows.pop()
        full[i] = [torch.randn(ctx, num_kv_heads, head_dim, generator=g) for _ in range(2)]
        qs[i] = torch.randn(n, num_heads, head_dim, generator=g)
        cached = ctx - n
        for b in range(cached // block_size):
            rows_b, t = slice(b * block_size, (b + 1) * block_size), tables[i][b]
            c, sc, zc = quantize_blocks(full[i][0][None, rows_b], name)
            k[t], params[0][t], params[1][t] = c[0], sc[0], zc[0]
            v[t], params[2][t] = quantize_rows(full[i][1][rows_b], name)
        rest = cached % block_size
        for x, o in zip(full[i], opened):
            o[open_row[i], :rest] = x[cached - rest:cached]
    n_q = num_heads // num_kv_heads
    dec = [i for i in order if seqs[i][1] == 1]
    pre = [i for i in order if seqs[i][1] > 1]
    split = [ids for ids in (dec[:len(dec) // 2], dec[len(dec) // 2:], pre) if ids]
    groups = [([seqs[i][1] for i in ids], [seqs[i][0] for i in ids], [[tables[i] for i in ids]])
              for ids in split]
    ob, tails = build_open_blocks(groups, [[open_row[i] for i in ids] for ids in split],
                                  block_size, None, num_kv_heads, head_dim, torch.float32,
                                  torch.device("cpu"))
    attn = [build_group(*grp, block_size, n_q, torch.device("cpu"), (*t, [open_row[i] for i in ids]))
            for grp, t, ids in zip(groups, tails, split)]
    ws = sum(len(t) for t in tables.values()) * 2
    md = AttentionMetadata(
        slot_mapping=[torch.zeros(0, dtype=torch.int64)], groups=attn,
        k_workspace=torch.empty(ws, block_size, num_kv_heads, head_dim),
        v_workspace=torch.empty(ws, block_size, num_kv_heads, head_dim),
        raw_workspace=torch.empty(ws, block_size, num_kv_heads, spec.code_dim(head_dim),
                                  dtype=spec.storage_dtype), open_blocks=ob)
    q = torch.cat([qs[i] for i in order])
    new = [torch.cat([full[i][j][seqs[i][0] - seqs[i][1]:] for i in order]) for j in range(2)]
    scale = head_dim ** -0.5
    if ops is None:
        out = paged_attention(q, *new, cache, md, scale, window)
    else:  # the kernel path: the same write, then the fused decode attention
        from pagedserve.attention.paged import write_kv_quantized
        write_kv_quantized(*new, cache, ob)
        out = paged_attention_fused(q, cache, md, scale, ops, torch.float32, window)
    ref = torch.cat([reference(qs[i], *full[i], seqs[i][1], block_size, name, scale, window)
                     for i in order])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for i in order:  # the blocks the step filled, and the open rows it left
        ctx, n = seqs[i]
        for b in range((ctx - n) // block_size, ctx // block_size):
            rows_b, t = slice(b * block_size, (b + 1) * block_size), tables[i][b]
            assert torch.equal(k[t], quantize_blocks(full[i][0][None, rows_b], name)[0][0])
            assert torch.equal(v[t], quantize_rows(full[i][1][rows_b], name)[0])
        last = (ctx - 1) // block_size * block_size
        for x, o in zip(full[i], opened):
            assert torch.equal(o[open_row[i], :ctx - last], x[last:ctx])
    return out


SEQS = [(1, 1), (4, 1), (5, 1), (37, 1), (64, 1), (23, 23), (50, 9), (16, 16), (40, 3)]


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("heads", [(4, 2), (9, 3)], ids=["gqa2", "gqa3"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_equals_dense_attention_on_the_values_held(name, heads, block_size):
    run_case(name, block_size, *heads, SEQS)
    run_case(name, block_size, *heads, SEQS, seed=2, window=6)  # a sliding-window layer


@pytest.mark.parametrize("name", MODES)
def test_decode_kernel_equals_dense_attention_on_the_values_held(name):
    from pagedserve import kernels

    ops = kernels.load()
    if ops is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    run_case(name, 4, 9, 3, SEQS, head_dim=64, ops=ops)
    run_case(name, 16, 4, 2, [(1, 1), (17, 1), (100, 1), (33, 1)], head_dim=32, seed=1, ops=ops)


# ---- end to end on a tiny random Llama ---------------------------------------------------

def _tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.mark.parametrize("kv_cache_dtype", MODES)
def test_prefix_hits_swap_and_recompute_give_the_same_tokens(tiny_llama, kv_cache_dtype):
    """The same quantized mode with and without prefix-cache hits and preemption (swap, and
    recompute in a pool of a tenth of the demand), and with prompts cut into chunks of 7:
    blocks are quantized when full and queries read their own block unquantized, so every
    schedule reads the same values."""
    from pagedserve import LLM

    prompts, params = shared_prefix_workload()
    plain = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    ref = _tokens(plain.generate(prompts, params, use_tqdm=False))
    assert plain.kv_cache_stats().num_preemptions == 0
    tight = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=60, block_size=4,
                preemption_mode="swap", swap_space=0.01, kv_cache_dtype=kv_cache_dtype)
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == ref
    stats = tight.kv_cache_stats()
    assert stats.prefix_cache_hits >= 44 * (len(prompts) - 1) // 2
    assert stats.num_swapped_out_blocks > 50
    assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks
    demand = sum(-(-(len(p["prompt_token_ids"]) + sp.max_tokens) // 4)
                 for p, sp in zip(prompts, params))
    small = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=max(60, demand // 10),
                block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=7,
                kv_cache_dtype=kv_cache_dtype)
    assert _tokens(small.generate(prompts, params, use_tqdm=False)) == ref
    assert small.kv_cache_stats().num_preemptions > 0
    # and the quantization is really in use: the full-precision run differs somewhere
    full = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4)
    assert _tokens(full.generate(prompts, params, use_tqdm=False)) != ref


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_sliding_window_model_and_both_paths(tiny_gemma3, monkeypatch, kernels):
    """Gemma 3's hybrid KV groups over an int8 cache, with the CPU kernels and without: prefix
    hits, chunks and preemption give the roomy run's tokens."""
    from pagedserve import LLM

    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", kernels)
    prompts, params = shared_prefix_workload(8)
    ref = _tokens(LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                      enable_prefix_caching=False, kv_cache_dtype="int8").generate(
        prompts, params, use_tqdm=False))
    tight = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=120, block_size=4,
                max_num_batched_tokens=9, kv_cache_dtype="int8")
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == ref
    stats = tight.kv_cache_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


@pytest.mark.parametrize("kv_cache_dtype", MODES)
def test_forks_copy_their_open_rows(tiny_llama, kv_cache_dtype):
    """n=3 greedy forks share the prompt's partial last block, whose K/V live in the
    parent's open row: every fork must equal the single greedy run."""
    from pagedserve import LLM, SamplingParams

    prompt = {"prompt_token_ids": [(7 * j + 3) % 300 + 3 for j in range(23)]}  # 5 blocks + 3
    outs = []
    for n in (1, 3):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=256, block_size=4,
                  kv_cache_dtype=kv_cache_dtype)
        params = SamplingParams(n=n, temperature=0, max_tokens=30, ignore_eos=True)
        outs.append(_tokens(llm.generate(prompt, params, use_tqdm=False)))
    assert outs[1] == outs[0] * 3


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_16_bit_caches_under_a_float32_model(tiny_llama, kv_cache_dtype):
    """A float16 cache under a float32 model takes the torch path (the CPU kernels store
    float32 or bfloat16 only; they once refused the float16 cache mid-step)."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=64,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(3, 40))}] * 2, params, use_tqdm=False)
    assert [len(t) for t in _tokens(out)] == [8, 8]


def test_generate_cli_takes_kv_cache_dtype(tiny_llama, capsys):
    from pagedserve.cli import build_parser, engine_kwargs, main

    assert engine_kwargs(build_parser().parse_args(
        ["serve", "--kv-cache-dtype", "int4"]))["kv_cache_dtype"] == "int4"
    assert main(["generate", "hello", "--model", tiny_llama, "--max-tokens", "4", "--no-chat",
                 "--kv-cache-dtype", "int4", "--num-kv-blocks", "32"]) == 0
    with pytest.raises(SystemExit):
        main(["generate", "hello", "--kv-cache-dtype", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err
