"""ModelRunner: one scheduled batch -> block copies, input tensors and AttentionMetadata ->
forward -> logits of the sequences that sample (and of the prompt positions of requests that
asked for prompt logprobs).

Tokens of a step are laid out decodes first, sorted by context length and cut into groups of
similar length, then the prefill chunks (see attention/metadata.py). Only the rows of requests whose scheduled chunk reaches their last token are projected to
logits and sampled; a partial prefill chunk only fills the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class ModelRunnerOutput:
    """``logits`` [len(sample_seqs), vocab] float32: one row per sequence that samples, in
    order. ``prompt_logits`` [sum of counts, vocab] float32: for each (sequence, first, count)
    of ``prompt_rows``, the rows at positions first .. first + count - 1, which predict prompt
    tokens first + 1 .. first + count."""

    sample_seqs: list[Sequence] = field(default_factory=list)
    logits: torch.Tensor | None = None
    prompt_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        cfg = model.config
        self.num_queries_per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
        self._workspaces: dict[str, torch.Tensor | None] = {"k": torch.empty(0)}

    def _workspace(self, rows: int) -> dict[str, torch.Tensor | None]:
        """Gather buffers (AttentionMetadata's ``*_workspace``) with at least ``rows`` blocks;
        grown, never shrunk, so the pages are touched once instead of every layer."""
        ws = self._workspaces
        if ws["k"].shape[0] < rows:
            spec, dev = self.kv_cache.spec, self.device
            shape = (max(rows, int(ws["k"].shape[0] * 1.5)), *self.kv_cache.kv.shape[3:])
            ws = {"k": torch.empty(shape, dtype=spec.compute_dtype, device=dev),
                  "v": torch.empty(shape, dtype=spec.compute_dtype, device=dev),
                  "raw": None, "scale": None}
            if spec.storage_dtype != spec.compute_dtype:
                ws["raw"] = torch.empty(shape, dtype=spec.storage_dtype, device=dev)
            if self.kv_cache.scales is not None:
                ws["scale"] = torch.empty(shape[:-1], dtype=self.kv_cache.scales.dtype,
                                          device=dev)
            self._workspaces = ws
        return ws

    def _group(self, items: list[tuple[Sequence, int]]):
        return build_group(
            [n for _, n in items],
            [s.num_computed_tokens + n for s, n in items],
            [s.block_table for s, _ in items],
            self.block_size, self.num_queries_per_kv, self.device,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: swap-out, swap-in and copy-on-write block copies, then the forward.
        Returns the logits of the sequences whose scheduled chunk reaches their last token, and
        of the computed prompt positions of requests that want prompt logprobs. Changes no
        sequence."""
        if sched.blocks_to_swap_out:
            self.kv_cache.swap_out(sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.kv_cache.swap_in(sched.blocks_to_swap_in)
        if sched.blocks_to_copy:
            self.kv_cache.copy_blocks(sched.blocks_to_copy)
        out = ModelRunnerOutput()
        if not sched.scheduled:
            return out
        groups = split_decodes([(s, n) for s, n in sched.scheduled if n == 1])
        prefills = [(s, n) for s, n in sched.scheduled if n > 1]
        if prefills:
            groups.append(prefills)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        for seq, n in (item for group in groups for item in group):
            start = seq.num_computed_tokens
            num_prompt = len(seq.request.prompt_token_ids)
            if seq.request.prompt_logprobs is not None and seq.index == 0 \
                    and start < num_prompt - 1:
                count = min(start + n, num_prompt - 1) - start
                out.prompt_rows.append((seq, start, count))
                prompt_rows.extend(range(len(input_ids), len(input_ids) + count))
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                out.sample_seqs.append(seq)
        attn_groups = [self._group(g) for g in groups]
        ws = self._workspace(max(g.num_seqs * g.max_blocks for g in attn_groups))
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            groups=attn_groups, k_workspace=ws["k"], v_workspace=ws["v"],
            raw_workspace=ws["raw"], scale_workspace=ws["scale"],
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache.layers, md,
        )
        for rows, name in ((sample_rows, "logits"), (prompt_rows, "prompt_logits")):
            if rows:
                index = torch.tensor(rows, dtype=torch.int64, device=self.device)
                setattr(out, name, self.model.compute_logits(hidden[index]))
        return out
