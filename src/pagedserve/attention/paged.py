"""Paged attention in torch (PagedAttention, Kwon et al., SOSP 2023, sec. 4.1), CPU and CUDA.

New K/V are written to their slots through ``slot_mapping``; each group of requests then
gathers its blocks through the block tables into a workspace and runs
``scaled_dot_product_attention`` with the group's mask. One call serves a mixed batch of
decodes and prefill chunks (queries over cached context plus the new tokens, causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionGroup, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` [num_tokens, num_kv_heads, head_dim] into the caches
    [num_blocks, block_size, num_kv_heads, head_dim] at rows ``slot_mapping`` [num_tokens]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  g: AttentionGroup, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] of one group -> output of the same shape."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    n_q = num_heads // num_kv_heads
    b, qlen, max_len = g.num_seqs, g.max_query_len, g.max_blocks * block_size
    rows = b * g.max_blocks
    k = torch.index_select(k_cache, 0, g.block_ids, out=md.k_workspace[:rows])
    v = torch.index_select(v_cache, 0, g.block_ids, out=md.v_workspace[:rows])
    k = k.view(b, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(b, max_len, num_kv_heads, head_dim).transpose(1, 2)
    if g.query_index is None:  # decodes: one query per request, G rows per KV head
        out = F.scaled_dot_product_attention(
            q.view(b, num_kv_heads, n_q, head_dim), k, v, attn_mask=g.mask, scale=scale)
        return out.reshape(b, num_heads, head_dim)
    qp = q[g.query_index].view(b, qlen, num_kv_heads, n_q, head_dim)
    qp = qp.permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, n_q * qlen, head_dim)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=g.mask, scale=scale)
    out = out.view(b, num_kv_heads, n_q, qlen, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(b * qlen, num_heads, head_dim)[g.output_index]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of one layer over the paged cache.

    Args:
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], the
            new tokens' keys and values (written to the cache first).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    Returns:
        [num_tokens, num_heads, head_dim], in the token order of ``q``.
    """
    write_kv(k, v, k_cache, v_cache, md.slot_mapping)
    if len(md.groups) == 1:
        return _attend_group(q, k_cache, v_cache, md.groups[0], md, scale)
    outs, start = [], 0
    for g in md.groups:
        outs.append(_attend_group(q[start:start + g.num_tokens], k_cache, v_cache, g, md, scale))
        start += g.num_tokens
    return torch.cat(outs)
