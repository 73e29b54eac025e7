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
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            inside = key_pos[None, None, :] > self.query_pos[:, :, None] - window
            if self.query_index is None:  # decodes: [num_seqs, 1, 1, keys]
                mask = self.mask & inside[:, None]
            else:  # [num_seqs, max_query_len, keys] -> the G query rows of each KV head
                g = self.num_queries_per_kv
                inside = inside[:, None].expand(-1, g, -1, -1).reshape(self.mask.shape)
                mask = self.mask & inside
            self._window_masks[window] = mask
        return mask


@dataclass
class AttentionMetadata:
    """Shapes: ``slot_mapping`` one tensor per KV group, [num_tokens] int64: the cache row
    each new token's K/V go to in that group's layers.
    ``k_workspace``/``v_workspace`` [rows, block_size, num_kv_heads, head_dim]: reusable buffers
    the K/V of a group are gathered into, in the model's dtype (allocated once, reused by every
    layer and step). When the cache stores another dtype, ``raw_workspace`` (same shape, the
    cache's dtype) and, for an 8-bit cache, ``scale_workspace`` [rows, block_size,
    num_kv_heads] receive the gathered blocks before they are converted."""

    slot_mapping: list[torch.Tensor]
    groups: list[AttentionGroup]
    k_workspace: torch.Tensor
    v_workspace: torch.Tensor
    raw_workspace: torch.Tensor | None = None
    scale_workspace: torch.Tensor | None = None


def _pad_block_ids(block_tables: list[list[int]]) -> tuple[int, list[int]]:
    max_blocks = max(len(t) for t in block_tables)
    flat: list[int] = []
    for t in block_tables:
        flat.extend(t)
        flat.extend([0] * (max_blocks - len(t)))
    return max_blocks, flat


def build_group(query_lens: list[int], seq_lens: list[int],
                block_tables: list[list[list[int]]], block_size: int, num_queries_per_kv: int,
                device: torch.device) -> AttentionGroup:
    """Metadata of one padded group. ``seq_lens[i]`` counts request i's tokens including the
    ``query_lens[i]`` new ones; its queries sit at positions ``seq_lens[i] - query_lens[i] ...``.
    ``block_tables[g][i]``: request i's table in KV group g (all of one length per request).
    """
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
                          num_queries_per_kv)
