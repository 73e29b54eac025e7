"""ModelRunner: one scheduled batch -> block copies, input tensors and AttentionMetadata ->
forward -> logits of the sequences that sample.

Tokens of a step are laid out decodes first, sorted by context length and cut into groups of
similar length, then the prefill chunks (see attention/metadata.py). Only the rows of requests whose scheduled chunk reaches their last token are projected to
logits and sampled; a partial prefill chunk only fills the KV cache.
"""

from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata, build_group
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.kv.cache import KVCache
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.sequence import Sequence

# A decode group closes when the next request needs more than this many times the blocks of the
# group's first (shortest) request, if the group already has MIN_GROUP_SEQS requests: padding
# then wastes at most half the gathered slots, and few groups keep per-layer overhead small.
GROUP_GROWTH = 2
MIN_GROUP_SEQS = 8


def split_decodes(decodes: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
    """Decodes sorted by block-table length, cut into groups of similar length."""
    if not decodes:
        return []
    items = sorted(decodes, key=lambda item: len(item[0].block_table))
    groups = [[items[0]]]
    for item in items[1:]:
        group = groups[-1]
        if (len(item[0].block_table) > GROUP_GROWTH * len(group[0][0].block_table)
                and len(group) >= MIN_GROUP_SEQS):
            groups.append([item])
        else:
            group.append(item)
    return groups


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        cfg = model.config
        self.num_queries_per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
        self._k_workspace = self._v_workspace = torch.empty(0)

    def _workspace(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather buffers with at least ``rows`` blocks; grown, never shrunk, so the pages are
        touched once instead of every layer."""
        if self._k_workspace.shape[0] < rows:
            shape = (max(rows, int(self._k_workspace.shape[0] * 1.5)),
                     *self.kv_cache.kv.shape[3:])
            self._k_workspace = torch.empty(shape, dtype=self.kv_cache.kv.dtype, device=self.device)
            self._v_workspace = torch.empty_like(self._k_workspace)
        return self._k_workspace, self._v_workspace

    def _group(self, items: list[tuple[Sequence, int]]):
        return build_group(
            [n for _, n in items],
            [s.num_computed_tokens + n for s, n in items],
            [s.block_table for s, _ in items],
            self.block_size, self.num_queries_per_kv, self.device,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run one step: swap-out, swap-in and copy-on-write block copies, then the forward.
        Returns the sequences whose scheduled chunk reaches their last token and their logits
        [num_sequences, vocab] float32 (rows in the same order). Changes no sequence."""
        if sched.blocks_to_swap_out:
            self.kv_cache.swap_out(sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.kv_cache.swap_in(sched.blocks_to_swap_in)
        if sched.blocks_to_copy:
            self.kv_cache.copy_blocks(sched.blocks_to_copy)
        if not sched.scheduled:
            return [], None
        groups = split_decodes([(s, n) for s, n in sched.scheduled if n == 1])
        prefills = [(s, n) for s, n in sched.scheduled if n > 1]
        if prefills:
            groups.append(prefills)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in (item for group in groups for item in group):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        attn_groups = [self._group(g) for g in groups]
        k_ws, v_ws = self._workspace(max(g.num_seqs * g.max_blocks for g in attn_groups))
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            groups=attn_groups, k_workspace=k_ws, v_workspace=v_ws,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache.layers, md,
        )
        if not sample_seqs:
            return [], None
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        return sample_seqs, self.model.compute_logits(hidden[rows])
