"""Paged attention in torch (PagedAttention, Kwon et al., SOSP 2023, sec. 4.1), CPU and CUDA.

New K/V are written to their slots through ``slot_mapping``; each group of requests then
gathers its blocks through the block tables into a workspace and runs
``scaled_dot_product_attention`` with the group's mask. One call serves a mixed batch of
decodes and prefill chunks (queries over cached context plus the new tokens, causal). An 8-bit cache is quantized
on the write and dequantized into the workspace on the gather (kv/quant.py), so attention
itself always runs in the model's dtype; every query, the new tokens' own included, reads K/V
as the cache holds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionGroup, AttentionMetadata
from pagedserve.kv.cache import LayerKVCache
from pagedserve.kv.quant import dequantize, quantize


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` [num_tokens, num_kv_heads, head_dim] into the cache's
    [num_blocks, block_size, num_kv_heads, head_dim] tensors at rows ``slot_mapping``
    [num_tokens], quantized (with their scales) for an 8-bit cache."""
    num_kv_heads, head_dim = cache.k.shape[2], cache.k.shape[3]
    for new, data, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        if scales is None:
            data.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                              new.to(data.dtype))
        else:
            q, s = quantize(new, cache.spec.name)
            data.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, q)
            scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, s)


def _gather(data: torch.Tensor, scales: torch.Tensor | None, cache: LayerKVCache,
            block_ids: torch.Tensor, out: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    """Blocks ``block_ids`` of ``data`` -> ``out`` [rows, block_size, num_kv_heads, head_dim] in
    the model's dtype (through the raw workspaces when the cache stores another dtype)."""
    rows = out.shape[0]
    if data.dtype == out.dtype:
        return torch.index_select(data, 0, block_ids, out=out)
    raw = torch.index_select(data, 0, block_ids, out=md.raw_workspace[:rows])
    if scales is None:
        return out.copy_(raw)
    s = torch.index_select(scales, 0, block_ids, out=md.scale_workspace[:rows])
    return dequantize(raw, s, cache.spec.name, out=out)


def _attend_group(q: torch.Tensor, cache: LayerKVCache, g: AttentionGroup,
                  md: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] of one group -> output of the same shape."""
    _, block_size, num_kv_heads, head_dim = cache.k.shape
    num_heads = q.shape[1]
    n_q = num_heads // num_kv_heads
    b, qlen, max_len = g.num_seqs, g.max_query_len, g.max_blocks * block_size
    rows = b * g.max_blocks
    ids = g.block_ids[cache.group]
    k = _gather(cache.k, cache.k_scale, cache, ids, md.k_workspace[:rows], md)
    v = _gather(cache.v, cache.v_scale, cache, ids, md.v_workspace[:rows], md)
    k = k.view(b, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(b, max_len, num_kv_heads, head_dim).transpose(1, 2)
    mask = g.window_mask(window)
    if g.query_index is None:  # decodes: one query per request, G rows per KV head
        out = F.scaled_dot_product_attention(
            q.view(b, num_kv_heads, n_q, head_dim), k, v, attn_mask=mask, scale=scale)
        return out.reshape(b, num_heads, head_dim)
    qp = q[g.query_index].view(b, qlen, num_kv_heads, n_q, head_dim)
    qp = qp.permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, n_q * qlen, head_dim)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
    out = out.view(b, num_kv_heads, n_q, qlen, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(b * qlen, num_heads, head_dim)[g.output_index]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    md: AttentionMetadata, scale: float, window: int | None = None
                    ) -> torch.Tensor:
    """Attention of one layer over the paged cache.

    Args:
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], the
            new tokens' keys and values (written to the cache first), all in the model's dtype.
        cache: the layer's K/V (and scales) [num_blocks, block_size, num_kv_heads, head_dim].
        window: a sliding-window layer's window (AttentionGroup.window_mask), or None.
    Returns:
        [num_tokens, num_heads, head_dim], in the token order of ``q``.
    """
    write_kv(k, v, cache, md.slot_mapping[cache.group])
    if len(md.groups) == 1:
        return _attend_group(q, cache, md.groups[0], md, scale, window)
    outs, start = [], 0
    for g in md.groups:
        outs.append(_attend_group(q[start:start + g.num_tokens], cache, g, md, scale, window))
        start += g.num_tokens
    return torch.cat(outs)


def paged_attention_fused(q: torch.Tensor, cache: LayerKVCache, md: AttentionMetadata,
                          scale: float, ops, out_dtype: torch.dtype, window: int | None = None
                          ) -> torch.Tensor:
    """Attention over a cache the new K/V are already in (``ops.rotary_write_kv`` wrote them):
    decode groups run ``ops.paged_decode_attention``, which reads the blocks in place (a
    sliding-window layer's only its window); prefill groups the torch path above.
    q [num_tokens, num_heads, head_dim] float32 -> the same shape of ``out_dtype``."""
    outs, start = [], 0
    for g in md.groups:
        gq = q[start:start + g.num_tokens]
        start += g.num_tokens
        if g.query_index is None:
            outs.append(ops.paged_decode_attention(
                gq, cache.k, cache.v, g.block_ids[cache.group].view(g.num_seqs, g.max_blocks),
                g.seq_lens,
                scale, out_dtype, window or 0))
        else:
            outs.append(_attend_group(gq, cache, g, md, scale, window).to(out_dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
