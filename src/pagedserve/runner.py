"""ModelRunner: one scheduled batch -> block copies, input tensors and AttentionMetadata ->
forward -> logits of the sequences that sample (and of the prompt positions of requests that
asked for prompt logprobs).

Tokens of a step are laid out decodes first, sorted by context length and cut into groups of
similar length, then the prefill chunks (see attention/metadata.py). Only the rows of requests
whose scheduled chunk reaches their last token are projected to logits and sampled; a partial
prefill chunk only fills the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedserve import envs
from pagedserve.attention.metadata import AttentionMetadata, build_group, build_open_blocks
from pagedserve.core.block_manager import OpenRowOps
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.cpu import ContentionGuard
from pagedserve.kv.cache import KVCache
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.sequence import Sequence

# A decode group closes when the next request needs more than this many times the blocks of the
# group's first (shortest) request, if the group already has MIN_GROUP_SEQS requests: padding
# then wastes at most half the gathered slots, and few groups keep per-layer overhead small.
GROUP_GROWTH = 2
MIN_GROUP_SEQS = 8


def split_decodes(decodes: list[tuple[Sequence, int, int]]
                  ) -> list[list[tuple[Sequence, int, int]]]:
    """Decode rows (sequence, first position, 1) sorted by block-table length (stable: a
    sequence's rows stay in order), cut into groups of similar length."""
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


class PromptRows(NamedTuple):
    """``count`` logits rows of ``seq``'s prompt positions from ``first`` on (each predicts
    the prompt token after it)."""

    seq: Sequence
    first: int
    count: int


@dataclass
class ModelRunnerOutput:
    """``logits`` [rows, vocab] float32: for each sequence that samples, in order, the row
    of its last token at ``first_rows[i]``, followed by one row per draft it verifies (its
    ``spec_token_ids``; speculative decoding): row ``first_rows[i] + j`` predicts the token
    after its j-th draft. ``prompt_logits`` [sum of counts, vocab] float32: for each (sequence, first, count)
    of ``prompt_rows``, the rows at positions first .. first + count - 1, which predict prompt
    tokens first + 1 .. first + count."""

    sample_seqs: list[Sequence] = field(default_factory=list)
    first_rows: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    prompt_rows: list[PromptRows] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None


@dataclass
class ModelInput:
    """One step as plain data (lists of ints, picklable): what every tensor-parallel rank needs
    to run the same forward. ``slot_mapping``: per KV group, each token's cache row;
    ``groups``: per attention group, (query_lens, seq_lens, block tables per KV group);
    ``sample_rows`` / ``prompt_rows``: token rows projected to logits; ``open_rows`` per
    attention group, each request's open-block row (a quantized cache), and ``open_ops`` the
    moves of those rows to do first; ``row_spans``: the rows as spans of prompt and
    generated tokens (AttentionMetadata.row_spans); ``prompt_groups``: per attention group,
    whether any of its rows is a prompt token's (AttentionGroup.prompt_rows)."""

    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
    open_ops: OpenRowOps = field(default_factory=OpenRowOps)
    open_rows: list[list[int]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[list[int]] = field(default_factory=list)
    groups: list[tuple[list[int], list[int], list[list[list[int]]]]] = field(
        default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    row_spans: list[tuple[int, int, bool]] = field(default_factory=list)
    prompt_groups: list[bool] = field(default_factory=list)


def _extend_spans(spans: list[tuple[int, int, bool]], start: int, count: int,
                  is_prompt: bool) -> None:
    """Append rows [start, start + count) of kind ``is_prompt`` to ``spans``, merged into the
    last span when it is of the same kind."""
    if count:
        if spans and spans[-1][2] == is_prompt:
            spans[-1] = (spans[-1][0], start + count, is_prompt)
        else:
            spans.append((start, start + count, is_prompt))


def _attention_groups(sched: SchedulerOutput, drafts_as_decodes: bool
                      ) -> list[list[tuple[Sequence, int, int]]]:
    """The step's (sequence, first position, tokens) items by attention group: the decode
    groups (split_decodes), then one of the prefill chunks. A prompt token is never a decode
    row, even alone: its attention is computed as in any other chunking of its prompt."""
    decodes, prefills = [], []
    for seq, n in sched.scheduled:
        start = seq.num_computed_tokens
        generated = start >= len(seq.request.prompt_token_ids)
        if (n == 1 and generated) or (drafts_as_decodes and start + 1 == seq.num_tokens):
            decodes.extend((seq, start + j, 1) for j in range(n))
        else:
            prefills.append((seq, start, n))
    groups = split_decodes(decodes)
    if prefills:
        groups.append(prefills)
    return groups


def prepare_input(sched: SchedulerOutput, block_size: int, num_kv_groups: int = 1,
                  drafts_as_decodes: bool = False) -> tuple[ModelInput, ModelRunnerOutput]:
    """Lay out one scheduled batch: the step's ModelInput (token ids, positions, the KV slot
    of each token from its sequence's block table, attention groups, the rows to project to
    logits), and an output naming the sequences whose logits it will carry (not yet
    filled). Reads the sequences; changes none.

    A chunk of a sequence's last token and its drafts (speculative decoding) is laid out as
    one decode row per token when ``drafts_as_decodes``: row j attends the positions up to
    its own, with the sequence's block table, which is the chunk's causal attention run by
    the decode kernel instead of the padded prefill path."""
    out = ModelRunnerOutput()
    inp = ModelInput(sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy,
                     sched.open_rows)
    groups = _attention_groups(sched, drafts_as_decodes)
    bs = block_size
    input_ids, positions = inp.input_ids, inp.positions
    inp.slot_mapping = [[] for _ in range(num_kv_groups)]
    rows: dict[int, tuple[Sequence, list[int]]] = {}  # sequence -> its rows that sample
    for seq, start, n in (item for group in groups for item in group):
        num_prompt = len(seq.request.prompt_token_ids)
        if seq.request.prompt_logprobs is not None and seq.index == 0 \
                and start < num_prompt - 1:
            count = min(start + n, num_prompt - 1) - start
            out.prompt_rows.append(PromptRows(seq, start, count))
            inp.prompt_rows.extend(range(len(input_ids), len(input_ids) + count))
        row, in_prompt = len(input_ids), min(max(num_prompt - start, 0), n)
        _extend_spans(inp.row_spans, row, in_prompt, True)
        _extend_spans(inp.row_spans, row + in_prompt, n - in_prompt, False)
        input_ids.extend(seq.token_ids[start:start + n])
        if start + n > seq.num_tokens:  # the chunk (or this decode row) is drafts
            input_ids.extend(seq.spec_token_ids[max(0, start - seq.num_tokens):
                                                start + n - seq.num_tokens])
        positions.extend(range(start, start + n))
        for table, slots in zip(seq.block_tables, inp.slot_mapping, strict=True):
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        first = max(start, seq.num_tokens - 1)  # the last token's row, then the drafts'
        if first < start + n:
            rows.setdefault(id(seq), (seq, []))[1].extend(
                range(len(input_ids) - (start + n - first), len(input_ids)))
    for seq, seq_rows in rows.values():
        out.sample_seqs.append(seq)
        out.first_rows.append(len(inp.sample_rows))
        inp.sample_rows.extend(seq_rows)
    inp.groups = [([n for _, _, n in g], [start + n for _, start, n in g],
                   [[s.block_tables[k] for s, _, _ in g] for k in range(num_kv_groups)])
                  for g in groups]
    inp.open_rows = [[s.open_row for s, _, _ in g] for g in groups]
    inp.prompt_groups = [any(start < len(s.request.prompt_token_ids) for s, start, _ in g)
                         for g in groups]
    return inp, out


class ModelRunner:
    """Runs steps on this process's model and KV cache (under tensor parallelism: this rank's
    shard; the logits come back on rank 0 only)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 watch_contention: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.num_kv_groups = len(kv_cache.layout.groups)
        cfg = model.config
        self.num_queries_per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
        self._workspaces: dict[str, torch.Tensor | None] = {"k": torch.empty(0)}
        self._tail: torch.Tensor | None = None  # OpenBlocks.tail, grown, never shrunk
        # one thread while the cores are shared (the engine's runner only: a draft model's
        # runs on the same thread)
        watch = watch_contention and device.type == "cpu" and envs.contention_guard()
        threads = torch.get_num_threads() if watch else 1
        self.contention = ContentionGuard(threads)

    def _workspace(self, rows: int) -> dict[str, torch.Tensor | None]:
        """Gather buffers (AttentionMetadata's ``*_workspace``) with at least ``rows`` blocks;
        grown, never shrunk, so the pages are touched once instead of every layer."""
        ws = self._workspaces
        if ws["k"].shape[0] < rows:
            spec, dev = self.kv_cache.spec, self.device
            cfg = self.model.config
            shape = (max(rows, int(ws["k"].shape[0] * 1.5)), self.block_size,
                     self.kv_cache.kv.shape[4], cfg.head_dim)
            ws = {"k": torch.empty(shape, dtype=spec.compute_dtype, device=dev),
                  "v": torch.empty(shape, dtype=spec.compute_dtype, device=dev),
                  "raw": None}
            if spec.storage_dtype != spec.compute_dtype:
                ws["raw"] = torch.empty((*shape[:3], self.kv_cache.kv.shape[5]),
                                        dtype=spec.storage_dtype, device=dev)
            self._workspaces = ws
        return ws

    def prepare(self, sched: SchedulerOutput) -> tuple[ModelInput, ModelRunnerOutput]:
        # a quantized cache's write kernel takes one open row per sequence: drafts stay a chunk
        return prepare_input(sched, self.block_size, self.num_kv_groups,
                             drafts_as_decodes=not self.kv_cache.spec.quantized)

    @torch.inference_mode()
    def execute_model(self, inp: ModelInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Block copies (swap out, swap in, copy-on-write), then the forward of ``inp``.
        Returns (logits of ``sample_rows``, logits of ``prompt_rows``), each None when there are
        no such rows or on a tensor-parallel rank other than 0. The first may live in a buffer
        that the next call overwrites (LlamaForCausalLM.compute_logits's ``reuse``)."""
        if inp.blocks_to_swap_out:
            self.kv_cache.swap_out(inp.blocks_to_swap_out)
        if inp.blocks_to_swap_in:
            self.kv_cache.swap_in(inp.blocks_to_swap_in)
        if inp.blocks_to_copy:
            self.kv_cache.copy_blocks(inp.blocks_to_copy)
        if inp.open_ops:
            self.kv_cache.move_open(inp.open_ops.copies, inp.open_ops.swap_out,
                                    inp.open_ops.swap_in)
        if not inp.input_ids:
            return None, None
        dev, open_blocks = self.device, None
        open_keys: list = [None] * len(inp.groups)
        if self.kv_cache.spec.quantized:
            cfg = self.model.config
            open_blocks, tails = build_open_blocks(
                inp.groups, inp.open_rows, self.block_size, self._tail,
                self.kv_cache.kv.shape[4], cfg.head_dim, self.kv_cache.spec.compute_dtype, dev,
                decode_tails=not self.model.fused_kernels(self.kv_cache.spec))
            self._tail = open_blocks.tail
            open_keys = [(*t, rows) for t, rows in zip(tails, inp.open_rows)]
        attn_groups = [build_group(q, s, t, self.block_size, self.num_queries_per_kv, dev, o)
                       for (q, s, t), o in zip(inp.groups, open_keys)]
        for g, prompt in zip(attn_groups, inp.prompt_groups):
            g.prompt_rows = prompt
        ws = self._workspace(max(g.num_seqs * g.max_blocks for g in attn_groups))
        md = AttentionMetadata(
            slot_mapping=[torch.tensor(s, dtype=torch.int64, device=dev)
                          for s in inp.slot_mapping],
            groups=attn_groups, k_workspace=ws["k"], v_workspace=ws["v"],
            raw_workspace=ws["raw"], open_blocks=open_blocks,
            row_spans=inp.row_spans if self.model.kernels.prefill_bf16 else [],
        )
        hidden = self.model(torch.tensor(inp.input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(inp.positions, dtype=torch.int64, device=dev),
                            self.kv_cache.layers, md)
        results = []
        # the sampled rows' logits are consumed within the step: their buffer is reused
        for rows, reuse in ((inp.sample_rows, True), (inp.prompt_rows, False)):
            index = torch.tensor(rows, dtype=torch.int64, device=dev)
            results.append(self.model.compute_logits(hidden[index], reuse) if rows else None)
        return results[0], results[1]

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Returns the logits of the sequences whose scheduled chunk reaches their
        last token, and of the computed prompt positions of requests that want prompt
        logprobs. Changes no sequence."""
        self.contention.check(sched.num_decode_rows + sched.num_prefill_tokens)
        inp, out = self.prepare(sched)
        out.logits, out.prompt_logits = self.execute_model(inp)
        return out
