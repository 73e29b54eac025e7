"""Paged attention against dense causal SDPA (fp32, 1e-5); with a bfloat16 cache, against
dense attention on the values the cache holds (stored then read back). Quantized caches have
their own such test in test_kv_quant.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionMetadata, build_group
from pagedserve.attention.paged import paged_attention, write_kv
from pagedserve.kv.cache import LayerKVCache
from pagedserve.kv.quant import resolve_kv_cache_dtype


def dense_reference(q, k, v, scale):
    """q [n, H, D] are the last n positions of k/v [ctx, Hkv, D]; causal; K/V repeated."""
    n, h, _ = q.shape
    ctx, hkv, _ = k.shape
    k = k.repeat_interleave(h // hkv, dim=1).transpose(0, 1)
    v = v.repeat_interleave(h // hkv, dim=1).transpose(0, 1)
    qpos = torch.arange(ctx - n, ctx)[:, None]
    mask = torch.arange(ctx)[None, :] <= qpos
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                          scale=scale).transpose(0, 1)


def stored(x, spec):
    """What a cache of ``spec`` gives back for x [..., head_dim] (float32)."""
    return x.to(spec.storage_dtype).float()


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, spec, g):
    """A cache of ``spec`` full of random (finite) values, so unmasked garbage would show."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=g).to(spec.storage_dtype) for _ in range(2))
    return LayerKVCache(k, v, spec)


def run_case(block_size, num_heads, num_kv_heads, seqs, head_dim=32, seed=0,
             kv_cache_dtype="auto", model_dtype=torch.float32):
    """seqs: list of (context_len_including_new, num_new_tokens). A bfloat16 model's queries
    and new K/V are rounded to bfloat16 and compared at bfloat16's tolerance."""
    g = torch.Generator().manual_seed(seed)
    spec = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 3
    cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, spec, g)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    scale = head_dim ** -0.5
    # decodes first, then prefills, as the runner lays them out
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] > 1)
    tables, full_k, full_v, qs, slots = {}, {}, {}, {}, {}
    for i in order:
        ctx, n = seqs[i]
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables[i] = table
        full_k[i] = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        full_v[i] = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        qs[i] = torch.randn(n, num_heads, head_dim, generator=g)
        cached = [table[p // block_size] * block_size + p % block_size for p in range(ctx - n)]
        if cached:  # the cached context
            write_kv(full_k[i][:ctx - n], full_v[i][:ctx - n], cache, torch.tensor(cached))
        slots[i] = [table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)]
    dec = [i for i in order if seqs[i][1] == 1]
    pre = [i for i in order if seqs[i][1] > 1]
    n_q = num_heads // num_kv_heads

    def group(ids):
        return build_group([seqs[i][1] for i in ids], [seqs[i][0] for i in ids],
                           [[tables[i] for i in ids]], block_size, n_q, torch.device("cpu"))

    # decodes in two groups (as the runner splits them by length), then the prefills
    cut = len(dec) // 2
    groups = [group(ids) for ids in (dec[:cut], dec[cut:], pre) if ids]
    rows = sum(len(t) for t in tables.values()) * 2
    md = AttentionMetadata(
        slot_mapping=[torch.tensor([s for i in order for s in slots[i]])], groups=groups,
        k_workspace=torch.empty(rows, block_size, num_kv_heads, head_dim, dtype=model_dtype),
        v_workspace=torch.empty(rows, block_size, num_kv_heads, head_dim, dtype=model_dtype),
    )
    q = torch.cat([qs[i] for i in order]).to(model_dtype)
    k_new = torch.cat([full_k[i][seqs[i][0] - seqs[i][1]:] for i in order]).to(model_dtype)
    v_new = torch.cat([full_v[i][seqs[i][0] - seqs[i][1]:] for i in order]).to(model_dtype)
    if spec.storage_dtype != model_dtype:
        md.raw_workspace = torch.empty(rows, block_size, num_kv_heads, head_dim,
                                       dtype=spec.storage_dtype)
    out = paged_attention(q, k_new, v_new, cache, md, scale)
    ref = torch.cat([dense_reference(qs[i].to(model_dtype).float(), stored(full_k[i], spec),
                                     stored(full_v[i], spec), scale) for i in order])
    assert out.shape == ref.shape and out.dtype == model_dtype
    tol = 1e-5 if model_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # the new tokens' K/V went to their slots
    for i in order:
        ctx, n = seqs[i]
        for p in range(ctx - n, ctx):
            b, off = tables[i][p // block_size], p % block_size
            assert torch.equal(cache.k[b, off], full_k[i][p].to(spec.storage_dtype))
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 1)], ids=["mha", "gqa2", "gqa3", "mqa"])
def test_mixed_prefill_and_decode(block_size, heads):
    # decodes with contexts that fill / do not fill the last block, a fresh prefill, a prefill
    # chunk over cached context, a one-token prompt
    seqs = [(1, 1), (block_size, 1), (block_size + 1, 1), (37, 1), (23, 23), (50, 9), (16, 16)]
    run_case(block_size, *heads, seqs)


@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_only_and_prefill_only(block_size):
    run_case(block_size, 4, 2, [(5, 1), (40, 1), (17, 1)])
    run_case(block_size, 4, 2, [(33, 33), (64, 32), (2, 2)], seed=1)


def test_single_long_sequence():
    run_case(16, 9, 3, [(300, 300)], head_dim=64)
    run_case(16, 9, 3, [(300, 1)], head_dim=64)


@pytest.mark.parametrize("heads", [(4, 2), (9, 3)], ids=["gqa2", "gqa3"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_bfloat16_cache_equals_attention_on_its_values(heads, block_size):
    seqs = [(1, 1), (block_size + 1, 1), (37, 1), (70, 1), (23, 23), (50, 9), (16, 16)]
    out = run_case(block_size, *heads, seqs, kv_cache_dtype="bfloat16")
    # and it is not the full-precision answer (the reference is really the stored values)
    full = run_case(block_size, *heads, seqs)
    assert (out - full).abs().max() > 1e-4


@pytest.mark.parametrize("block_size", [4, 16])
def test_bfloat16_model_prefill_with_context(block_size):
    """A bfloat16 model's chunk over cached context keeps its dtype through the merge of the
    context and chunk attention."""
    run_case(block_size, 9, 3, [(50, 9), (37, 1), (23, 23), (70, 16)],
             model_dtype=torch.bfloat16)
