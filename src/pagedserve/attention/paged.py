"""Paged attention in torch (PagedAttention, Kwon et al., SOSP 2023, sec. 4.1), CPU and CUDA.

New K/V are written to their slots through ``slot_mapping``; each group of requests then
gathers its blocks through the block tables into a workspace and runs
``scaled_dot_product_attention`` with the group's mask. One call serves a mixed batch of
decodes and prefill chunks (queries over cached context plus the new tokens, causal). A
quantized cache (kv/quant.py) is written through ``write_kv_quantized`` and dequantized into
the workspace on the gather, so attention itself always runs in the model's dtype: every query
reads the blocks before its own block quantized and its own block unquantized (the group's
tail keys, AttentionGroup).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionGroup, AttentionMetadata, OpenBlocks
from pagedserve.kv.cache import LayerKVCache
from pagedserve.kv.quant import (
    dequantize_blocks,
    dequantize_rows,
    quantize_blocks,
    quantize_rows,
)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` [num_tokens, num_kv_heads, head_dim] into a full-precision cache's
    [num_blocks, block_size, num_kv_heads, head_dim] tensors at rows ``slot_mapping``
    [num_tokens]."""
    num_kv_heads, head_dim = cache.k.shape[2], cache.k.shape[3]
    for new, data in ((k, cache.k), (v, cache.v)):
        data.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, new.to(data.dtype))


def write_kv_quantized(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                       ob: OpenBlocks) -> None:
    """Store a step's new K/V [num_tokens, num_kv_heads, head_dim] in a quantized cache: into
    ``ob.tail`` after the open rows written before, then every block the step fills quantized
    from the tail, and the new rows of each request's last block kept in its open row
    (kv/quant.py)."""
    name, block_size = cache.spec.name, cache.k.shape[1]
    for new, tail, opened in ((k, ob.tail[0], cache.k_open), (v, ob.tail[1], cache.v_open)):
        opened = opened.view(-1, *opened.shape[2:])
        if ob.old_src.numel():
            tail.index_copy_(0, ob.old_dst, opened.index_select(0, ob.old_src))
        tail.index_copy_(0, ob.new_dst, new.to(tail.dtype))  # every token: new_src is all
        opened.index_copy_(0, ob.upd_dst, tail.index_select(0, ob.upd_src))
    if ob.fill_rows.numel():
        ids = ob.fill_blocks[cache.group]
        blocks = ob.tail[:, ob.fill_rows].view(2, -1, block_size, *ob.tail.shape[2:])
        codes, scale, zero = quantize_blocks(blocks[0], name)  # K per channel
        cache.k.index_copy_(0, ids, codes)
        cache.k_scale.index_copy_(0, ids, scale)
        cache.k_zero.index_copy_(0, ids, zero)
        codes, scale = quantize_rows(blocks[1], name)  # V per token
        cache.v.index_copy_(0, ids, codes)
        cache.v_scale.index_copy_(0, ids, scale)


def _gather(data: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor,
            md: AttentionMetadata) -> torch.Tensor:
    """Blocks ``block_ids`` of a full-precision ``data`` -> ``out`` [rows, block_size,
    num_kv_heads, head_dim] in the model's dtype (through the raw workspace when the cache
    stores another dtype)."""
    rows = out.shape[0]
    if data.dtype == out.dtype:
        return torch.index_select(data, 0, block_ids, out=out)
    return out.copy_(torch.index_select(data, 0, block_ids, out=md.raw_workspace[:rows]))


def _gather_quantized(cache: LayerKVCache, block_ids: torch.Tensor, k_out: torch.Tensor,
                      v_out: torch.Tensor, md: AttentionMetadata) -> None:
    """Blocks ``block_ids`` of a quantized cache, dequantized into ``k_out``/``v_out``."""
    rows, name = k_out.shape[0], cache.spec.name
    raw = torch.index_select(cache.k, 0, block_ids, out=md.raw_workspace[:rows])
    dequantize_blocks(raw, cache.k_scale.index_select(0, block_ids),
                      cache.k_zero.index_select(0, block_ids), name, out=k_out)
    raw = torch.index_select(cache.v, 0, block_ids, out=md.raw_workspace[:rows])
    dequantize_rows(raw, cache.v_scale.index_select(0, block_ids), name, out=v_out)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: q [1, H, Lq, D], k/v [1, H, Lk, D] -> (out [1, H, Lq, D],
    logsumexp [1, H, Lq] float32); ``causal`` aligns query i with key i (Lq == Lk)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


def _attend_causal(q: torch.Tensor, cache: LayerKVCache, g: AttentionGroup,
                   md: AttentionMetadata, scale: float) -> torch.Tensor:
    """A CPU prefill group of a full-attention layer over an unquantized cache, request by
    request and without a mask: each request's queries attend its cached context (keys before
    its chunk: every query sees all of them) and, causally, its chunk's own keys, as two flash
    attention calls merged by their log-sum-exp (the split of FlashAttention's online softmax,
    Dao et al. 2022, sec. 3.1). The masked path computes every query against every padded key
    and converts the boolean mask each layer: at 2,048 tokens this is about twice as fast.
    q [num_tokens, num_heads, head_dim] in request order -> the same shape."""
    bs, kvh, hd = cache.k.shape[1:]
    heads = q.shape[1]
    ids = g.block_ids[cache.group].view(g.num_seqs, g.max_blocks)
    outs, start = [], 0
    for i, (qlen, slen) in enumerate(g.lens):
        ctx, nb = slen - qlen, -(-slen // bs)
        k = _gather(cache.k, ids[i, :nb], md.k_workspace[:nb], md).view(1, nb * bs, kvh, hd)
        v = _gather(cache.v, ids[i, :nb], md.v_workspace[:nb], md).view(1, nb * bs, kvh, hd)
        # [1, L, KVH, D] -> [1, H, L, D]: each KV head repeated for its query heads
        k = k[:, :slen].transpose(1, 2).repeat_interleave(heads // kvh, 1)
        v = v[:, :slen].transpose(1, 2).repeat_interleave(heads // kvh, 1)
        qi = q[start:start + qlen].transpose(0, 1)[None]
        start += qlen
        out, lse = _flash(qi, k[:, :, ctx:], v[:, :, ctx:], True, scale)
        if ctx:
            out_c, lse_c = _flash(qi, k[:, :, :ctx], v[:, :, :ctx], False, scale)
            w = torch.sigmoid(lse - lse_c)[..., None]  # = e^lse / (e^lse + e^lse_c)
            out = (out_c + (out - out_c) * w).to(q.dtype)
        outs.append(out[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_group(q: torch.Tensor, cache: LayerKVCache, g: AttentionGroup,
                  md: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] of one group -> output of the same shape."""
    if g.query_index is not None and window is None and not cache.spec.quantized \
            and q.device.type == "cpu" and g.lens:
        return _attend_causal(q, cache, g, md, scale)
    _, block_size, num_kv_heads, head_dim = cache.v.shape[:3] + (q.shape[-1],)
    num_heads = q.shape[1]
    n_q = num_heads // num_kv_heads
    b, qlen, max_len = g.num_seqs, g.max_query_len, g.max_blocks * block_size
    rows = b * g.max_blocks
    ids = g.block_ids[cache.group]
    k, v = md.k_workspace[:rows], md.v_workspace[:rows]
    if cache.spec.quantized:
        _gather_quantized(cache, ids, k, v, md)
        # then the tail keys: the requests' own blocks, unquantized
        tail = md.open_blocks.tail[:, g.tail_offset:g.tail_offset + b * g.tail_len]
        tail = tail.view(2, b, g.tail_len, num_kv_heads, head_dim)
        k = torch.cat([k.view(b, max_len, num_kv_heads, head_dim), tail[0]], 1)
        v = torch.cat([v.view(b, max_len, num_kv_heads, head_dim), tail[1]], 1)
    else:
        k = _gather(cache.k, ids, k, md).view(b, max_len, num_kv_heads, head_dim)
        v = _gather(cache.v, ids, v, md).view(b, max_len, num_kv_heads, head_dim)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
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
    if cache.spec.quantized:
        write_kv_quantized(k, v, cache, md.open_blocks)
    else:
        write_kv(k, v, cache, md.slot_mapping[cache.group])
    if len(md.groups) == 1:
        return _attend_group(q, cache, md.groups[0], md, scale, window)
    outs, start = [], 0
    for g in md.groups:
        outs.append(_attend_group(q[start:start + g.num_tokens], cache, g, md, scale, window))
        start += g.num_tokens
    return torch.cat(outs)


KERNEL_KIND = {"int8": 0, "fp8": 1, "int4": 2}  # the quantized kernels' ``kind``


def rotary_write_kv_quantized(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                              cache: LayerKVCache, md: AttentionMetadata, num_heads: int,
                              ops) -> torch.Tensor:
    """The CPU kernel's write of a quantized cache (``ops.rotary_write_kv_quant``: rotary, the
    open rows, the blocks that fill), plus the tails of the step's prefill groups (OpenBlocks
    built with ``decode_tails`` False). qkv [T, (H + 2 KVH) D] -> the rotated queries
    [T, H, D] float32."""
    ob = md.open_blocks
    kvh, hd = cache.k_open.shape[2:]
    k_out = None
    if ob.new_dst.numel():  # the prefill groups' tails: the open rows before they change
        for tail, opened in ((ob.tail[0], cache.k_open), (ob.tail[1], cache.v_open)):
            if ob.old_src.numel():
                tail.index_copy_(0, ob.old_dst, opened.view(-1, kvh, hd).index_select(
                    0, ob.old_src))
        k_out = torch.empty(qkv.shape[0], kvh, hd)
    q = ops.rotary_write_kv_quant(qkv, rope[0], rope[1], md.slot_mapping[cache.group],
                                  ob.seq_starts, ob.seq_open_rows, cache.k_open, cache.v_open,
                                  cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale,
                                  k_out, num_heads, kvh, KERNEL_KIND[cache.spec.name],
                                  torch.float32)
    if k_out is not None:  # then the new rows
        v = qkv[:, (num_heads + kvh) * hd:].view(-1, kvh, hd)
        ob.tail[0].index_copy_(0, ob.new_dst, k_out.index_select(0, ob.new_src))
        ob.tail[1].index_copy_(0, ob.new_dst, v.index_select(0, ob.new_src).float())
    return q


def paged_attention_fused(q: torch.Tensor, cache: LayerKVCache, md: AttentionMetadata,
                          scale: float, ops, out_dtype: torch.dtype, window: int | None = None
                          ) -> torch.Tensor:
    """Attention over a cache the new K/V are already in (``ops.rotary_write_kv`` or
    ``write_kv_quantized`` wrote them): decode groups run ``ops.paged_decode_attention`` (a
    quantized cache ``ops.paged_decode_attention_quant``), which reads the blocks in place (a
    sliding-window layer's only its window); prefill groups ``ops.paged_prefill_attention``,
    whose rows come out bit-identical however the prompt is chunked (a quantized cache: the
    torch path above).
    q [num_tokens, num_heads, head_dim] float32 -> the same shape of ``out_dtype``."""
    outs, start = [], 0
    for g in md.groups:
        gq = q[start:start + g.num_tokens]
        start += g.num_tokens
        if g.query_index is None and cache.spec.quantized:
            outs.append(ops.paged_decode_attention_quant(
                gq, cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale, cache.k_open,
                cache.v_open,
                g.block_ids[cache.group].view(g.num_seqs, g.max_blocks), g.seq_lens,
                g.open_rows, scale, out_dtype, window or 0, KERNEL_KIND[cache.spec.name]))
        elif g.query_index is None and not g.prompt_rows:
            outs.append(ops.paged_decode_attention(
                gq, cache.k, cache.v, g.block_ids[cache.group].view(g.num_seqs, g.max_blocks),
                g.seq_lens,
                scale, out_dtype, window or 0))
        elif not cache.spec.quantized:
            outs.append(ops.paged_prefill_attention(
                gq, cache.k, cache.v, g.block_ids[cache.group].view(g.num_seqs, g.max_blocks),
                g.seq_lens, g.query_lens if g.query_lens is not None else
                torch.ones_like(g.seq_lens), scale, out_dtype, window or 0))
        else:
            outs.append(_attend_group(gq, cache, g, md, scale, window).to(out_dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
