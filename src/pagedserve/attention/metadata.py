"""AttentionMetadata: everything attention needs for one step, built once and shared by all
layers (passed explicitly through ``forward``; no global context).

A step's tokens are split into groups, each request's tokens contiguous and the groups in token
order: decodes (one-token queries) in a few groups of similar context length, then the prefill
chunks. Each group is attended as a padded batch: block tables padded to the group's longest,
queries padded to its longest chunk; the boolean mask (True = attend) hides padding and
enforces causality, so no padded key is ever read into a result. Query heads are folded into rows per KV head (GQA/MQA: ``G =
num_heads // num_kv_heads`` query rows share one K/V head) so K/V are never repeated.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionGroup:
    """A padded batch of ``num_seqs`` requests attended together.

    Shapes: ``block_ids`` one tensor per KV group, [num_seqs * max_blocks] int64 (each row's
    block table in that group, padded with block 0; a window group's null entries read block
    0 too, which its window mask hides); ``seq_lens`` [num_seqs] int64 (cached + new tokens); ``mask`` [num_seqs, 1,
    G * max_query_len, max_blocks * block_size] bool (for a decode group [num_seqs, 1, 1, ...],
    broadcast over the G rows); ``query_index``
    [num_seqs, max_query_len] int64 into the group's tokens and ``output_index``
    [num_tokens] int64 into the padded ``num_seqs * max_query_len`` rows, both None when every
    query is one token long. ``query_pos`` [num_seqs, max_query_len] int64: each query's
    position (padded rows 0), from which ``window_mask`` derives sliding-window masks.
    ``lens``: each request's (query_len, seq_len) as Python ints, and ``query_lens`` the
    query lengths [num_seqs] int64 (both empty / None for a decode group).
    """

    num_seqs: int
    num_tokens: int
    max_blocks: int
    max_query_len: int
    block_ids: list[torch.Tensor]
    seq_lens: torch.Tensor
    mask: torch.Tensor
    query_index: torch.Tensor | None
    output_index: torch.Tensor | None
    query_pos: torch.Tensor
    num_queries_per_kv: int
    lens: list[tuple[int, int]] = field(default_factory=list)
    query_lens: torch.Tensor | None = None
    # Some rows are prompt tokens: a decode group's (prompt chunks of one token) then runs the
    # prefill kernel too, so that a prompt row's attention is one computation whatever the
    # length of the chunk it comes in.
    prompt_rows: bool = False
    # A quantized cache (kv/quant.py): the keys are the gathered blocks followed by each
    # request's ``tail_len`` tail rows (its unquantized K/V of positions from the start of its
    # chunk's first block); ``key_pos`` [num_seqs, max_blocks * block_size + tail_len] int64
    # gives each key's position, ``tail_offset`` the group's first row in OpenBlocks.tail, and
    # ``open_rows`` [num_seqs] each request's open row (the cache's kv_open).
    tail_len: int = 0
    tail_offset: int = 0
    key_pos: torch.Tensor | None = None
    open_rows: torch.Tensor | None = None
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int | None) -> torch.Tensor:
        """The mask of a layer that attends only the last ``window`` positions (None: all,
        ``mask``): the query at position i sees key j when i - window < j <= i, the rule of
        Mistral's and Gemma's sliding-window layers (Beltagy et al. 2020, Longformer).
        Built once per group and window."""
        if window is None:
            return self.mask
        mask = self._window_masks.get(window)
        if mask is None:
            key_pos = self.key_pos if self.key_pos is not None else \
                torch.arange(self.mask.shape[-1], device=self.mask.device)[None]
            inside = key_pos[:, None, :] > self.query_pos[:, :, None] - window
            if self.query_index is None:  # decodes: [num_seqs, 1, 1, keys]
                mask = self.mask & inside[:, None]
            else:  # [num_seqs, max_query_len, keys] -> the G query rows of each KV head
                g = self.num_queries_per_kv
                inside = inside[:, None].expand(-1, g, -1, -1).reshape(self.mask.shape)
                mask = self.mask & inside
            self._window_masks[window] = mask
        return mask


@dataclass
class OpenBlocks:
    """A quantized cache's bookkeeping for one step (kv/quant.py), shared by all layers.
    ``tail`` [2 (K, V), rows, num_kv_heads, head_dim] is a zero-initialized workspace of the
    model's dtype: each attention group's requests, ``tail_len`` rows each from the group's
    ``tail_offset``, get their unquantized K/V of positions ``block_start(c) .. c + n - 1`` (c:
    computed tokens, n: new ones): the open rows written before (``old_src`` rows of a flat
    open-row tensor [num_open * block_size] -> ``old_dst`` tail rows), then the new tokens
    (``new_dst``, in token order). ``fill_rows`` [num_fill * block_size]: the tail rows of the
    blocks this step fills, quantized into ``fill_blocks`` (per KV group, [num_fill] block
    ids). ``upd_src`` tail rows -> ``upd_dst`` open rows: each request's new rows of the last
    block it writes (all int64). ``seq_starts`` [num_seqs + 1] and ``seq_open_rows``
    [num_seqs]: each request's first token and open row, for the CPU kernel's write, which
    does the fills and updates itself; with ``decode_tails`` False (that kernel's steps) the
    decode groups get no tail and the tail lists cover only the prefill tokens, ``new_src``
    [their count] naming them among the step's tokens."""

    tail: torch.Tensor
    old_src: torch.Tensor
    old_dst: torch.Tensor
    new_src: torch.Tensor
    new_dst: torch.Tensor
    fill_rows: torch.Tensor
    fill_blocks: list[torch.Tensor]
    upd_src: torch.Tensor
    upd_dst: torch.Tensor
    seq_starts: torch.Tensor
    seq_open_rows: torch.Tensor


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    # through an array: a third of torch.tensor's time on a list
    if not values:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array("q", values), dtype=torch.int64).to(device)


def build_open_blocks(groups: list[tuple[list[int], list[int], list[list[list[int]]]]],
                      open_rows: list[list[int]], block_size: int, tail: torch.Tensor | None,
                      num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device, decode_tails: bool = True
                      ) -> tuple[OpenBlocks, list[tuple[int, int]]]:
    """The OpenBlocks of a step whose attention groups are ``groups`` ((query_lens, seq_lens,
    block tables per KV group), runner.ModelInput's) with ``open_rows`` per group, reusing
    ``tail`` when it is large enough. Returns it and (tail_offset, tail_len) per group."""
    bs = block_size
    old_src, old_dst, new_src, new_dst, fill_rows, upd_src, upd_dst = ([] for _ in range(7))
    fill_blocks: list[list[int]] = [[] for _ in groups[0][2]] if groups else []
    seq_starts, seq_rows = [0], []
    layout, offset, token = [], 0, 0
    for (query_lens, seq_lens, tables), rows in zip(groups, open_rows, strict=True):
        for n, r in zip(query_lens, rows):
            seq_starts.append(seq_starts[-1] + n)
            seq_rows.append(r)
        if not decode_tails and max(query_lens) == 1:
            layout.append((offset, 0))
            token += len(query_lens)
            continue
        width = max(s - (s - n) // bs * bs for n, s in zip(query_lens, seq_lens))
        layout.append((offset, width))
        for i, (n, s, r) in enumerate(zip(query_lens, seq_lens, rows)):
            new_src.extend(range(token, token + n))
            token += n
            c = s - n
            first_block = c // bs
            start, base = first_block * bs, offset + i * width
            old_src.extend(range(r * bs, r * bs + c - start))
            old_dst.extend(range(base, base + c - start))
            new_dst.extend(range(base + c - start, base + s - start))
            for b in range(first_block, s // bs):  # the blocks this chunk fills
                fill_rows.extend(range(base + (b - first_block) * bs,
                                       base + (b - first_block + 1) * bs))
                for g, table in enumerate(tables):
                    fill_blocks[g].append(table[i][b])
            last = (s - 1) // bs * bs  # the last block written: its new rows stay open
            lo = max(c, last)
            upd_src.extend(range(base + lo - start, base + s - start))
            upd_dst.extend(range(r * bs + lo - last, r * bs + s - last))
        offset += len(query_lens) * width
    if tail is None or tail.shape[1] < offset or tail.dtype != dtype:
        tail = torch.zeros(2, max(offset, 2 * (0 if tail is None else tail.shape[1])),
                           num_kv_heads, head_dim, dtype=dtype, device=device)
    ob = OpenBlocks(tail, _ids(old_src, device), _ids(old_dst, device), _ids(new_src, device),
                    _ids(new_dst, device), _ids(fill_rows, device),
                    [_ids(f, device) for f in fill_blocks], _ids(upd_src, device),
                    _ids(upd_dst, device), _ids(seq_starts, device), _ids(seq_rows, device))
    return ob, layout


@dataclass
class AttentionMetadata:
    """Shapes: ``slot_mapping`` one tensor per KV group, [num_tokens] int64: the cache row
    each new token's K/V go to in that group's layers.
    ``k_workspace``/``v_workspace`` [rows, block_size, num_kv_heads, head_dim]: reusable buffers
    the K/V of a group are gathered into, in the model's dtype (allocated once, reused by every
    layer and step). When the cache stores another dtype, ``raw_workspace`` (the same shape
    but the cache's dtype and code_dim) receives the gathered blocks before they are
    converted. ``open_blocks``: a quantized cache's bookkeeping (OpenBlocks).
    ``row_spans``: the step's token rows as consecutive spans (start, end, is_prompt) covering
    them all, is_prompt when the rows' positions are inside their request's prompt (what
    ``prefill_dtype`` bfloat16 multiplies in bfloat16); empty when not asked for."""

    slot_mapping: list[torch.Tensor]
    groups: list[AttentionGroup]
    k_workspace: torch.Tensor
    v_workspace: torch.Tensor
    raw_workspace: torch.Tensor | None = None
    open_blocks: OpenBlocks | None = None
    row_spans: list[tuple[int, int, bool]] = field(default_factory=list)


def _pad_block_ids(block_tables: list[list[int]]) -> tuple[int, list[int]]:
    max_blocks = max(len(t) for t in block_tables)
    flat: list[int] = []
    for t in block_tables:
        flat.extend(t)
        flat.extend([0] * (max_blocks - len(t)))
    return max_blocks, flat


def _open_keys(g: AttentionGroup, block_size: int, tail_offset: int, tail_len: int,
               open_rows: list[int], device: torch.device) -> AttentionGroup:
    """Turn ``g`` into a group over a quantized cache: keys are its gathered blocks, then
    ``tail_len`` tail rows per request (see AttentionGroup). A query reads the blocks before
    its own block quantized and its own block's rows from the tail, unquantized: a rule of
    positions only, so every chunking of a prompt reads the same values."""
    bs, b = block_size, g.num_seqs
    max_len = g.max_blocks * bs
    q_pos = g.query_pos  # [b, qlen]; a request's first query sits at its chunk's start
    start = q_pos[:, 0] // bs * bs
    tail_pos = start[:, None] + torch.arange(tail_len, device=device)[None, :]
    key_pos = torch.cat([torch.arange(max_len, device=device)[None].expand(b, -1), tail_pos], 1)
    q_block = q_pos // bs
    quant = (torch.arange(max_len, device=device) // bs)[None, None, :] < q_block[:, :, None]
    tail = ((tail_pos // bs)[:, None, :] == q_block[:, :, None]) \
        & (tail_pos[:, None, :] <= q_pos[:, :, None]) \
        & (tail_pos < g.seq_lens[:, None])[:, None, :]
    mask = torch.cat([quant, tail], 2)  # [b, qlen, keys]
    if g.query_index is not None:  # padded query rows attend key 0 only (never an empty row)
        padded = torch.ones(b * g.max_query_len, dtype=torch.bool, device=device)
        padded[g.output_index] = False
        padded = padded.view(b, g.max_query_len)
        mask[padded] = False
        mask[..., 0] |= padded
        mask = mask[:, None].expand(-1, g.num_queries_per_kv, -1, -1).reshape(
            b, 1, g.num_queries_per_kv * g.max_query_len, -1)
    else:
        mask = mask[:, None]
    g.mask, g.key_pos = mask, key_pos
    g.tail_len, g.tail_offset = tail_len, tail_offset
    g.open_rows = torch.tensor(open_rows, dtype=torch.int64, device=device)
    return g


def build_group(query_lens: list[int], seq_lens: list[int],
                block_tables: list[list[list[int]]], block_size: int, num_queries_per_kv: int,
                device: torch.device, open_keys: tuple[int, int, list[int]] | None = None
                ) -> AttentionGroup:
    """Metadata of one padded group. ``seq_lens[i]`` counts request i's tokens including the
    ``query_lens[i]`` new ones; its queries sit at positions ``seq_lens[i] - query_lens[i] ...``.
    ``block_tables[g][i]``: request i's table in KV group g (all of one length per request).
    ``open_keys`` (a quantized cache): (tail_offset, tail_len, open rows) of the group, from
    build_open_blocks.
    """
    g = _build_group(query_lens, seq_lens, block_tables, block_size, num_queries_per_kv,
                     device)
    if open_keys is not None:
        g = _open_keys(g, block_size, *open_keys, device)
    return g


def _build_group(query_lens: list[int], seq_lens: list[int],
                 block_tables: list[list[list[int]]], block_size: int,
                 num_queries_per_kv: int, device: torch.device) -> AttentionGroup:
    num_seqs = len(query_lens)
    block_ids = []
    for tables in block_tables:
        max_blocks, flat = _pad_block_ids(tables)
        # through an array: a third of torch.tensor's time on a list; null entries read block 0
        ids = torch.frombuffer(array("q", flat), dtype=torch.int64).clamp_(min=0) if flat \
            else torch.zeros(0, dtype=torch.int64)
        block_ids.append(ids.to(device))
    max_len = max_blocks * block_size
    key_pos = torch.arange(max_len, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    max_query_len = max(query_lens)
    if max_query_len == 1:
        mask = (key_pos[None, :] < seq_lens_t[:, None])[:, None, None, :]
        return AttentionGroup(num_seqs, num_seqs, max_blocks, 1, block_ids, seq_lens_t, mask,
                              None, None, (seq_lens_t - 1)[:, None], num_queries_per_kv)
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64, device=device)
    j = torch.arange(max_query_len, device=device)
    valid = j[None, :] < query_lens_t[:, None]  # [num_seqs, max_query_len]
    # Padded query rows sit at position 0: they attend key 0 only (never an empty row).
    q_pos = torch.where(valid, (seq_lens_t - query_lens_t)[:, None] + j[None, :], 0)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # causal over cached + new keys
    mask = mask[:, None].expand(-1, num_queries_per_kv, -1, -1)
    mask = mask.reshape(num_seqs, 1, num_queries_per_kv * max_query_len, max_len)
    starts = torch.cumsum(query_lens_t, 0) - query_lens_t
    query_index = torch.where(valid, starts[:, None] + j[None, :], 0)
    output_index = (torch.arange(num_seqs, device=device)[:, None] * max_query_len + j)[valid]
    return AttentionGroup(num_seqs, sum(query_lens), max_blocks, max_query_len, block_ids,
                          seq_lens_t, mask, query_index, output_index, q_pos,
                          num_queries_per_kv, list(zip(query_lens, seq_lens)), query_lens_t)
