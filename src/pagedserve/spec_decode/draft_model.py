"""Drafts from a smaller model with the target's vocabulary (Leviathan et al., ICML 2023).

The draft model runs in the engine's process with its own paged KV cache, block manager and a
mirror ``Sequence`` per drafting sequence (the same request, its own block table). Each
proposal first catches the mirror up: it keeps the longest prefix its cache holds of the
sequence's tokens (a rejected draft's slots are rolled back as in the target), computes the
tokens after it in one forward, then decodes ``k`` drafts greedily, one forward per draft for
all drafting sequences together. Greedy drafts are deterministic, so the target's acceptance
rule is the one of ngram drafts (sampler.py) and the output distribution stays the target's.
"""

from __future__ import annotations

import logging

import torch

from pagedserve.core.block_manager import BlockManager, cdiv
from pagedserve.core.scheduler import ScheduledChunk, SchedulerOutput
from pagedserve.distributed.parallel_state import TPGroup
from pagedserve.kv.cache import KVCache
from pagedserve.kv.quant import resolve_kv_cache_dtype
from pagedserve.kv.spec import kv_layout
from pagedserve.loader import open_model
from pagedserve.runner import ModelRunner
from pagedserve.sequence import Sequence

logger = logging.getLogger("pagedserve")

MIRROR_INDEX = -1  # a mirror is no sequence of its request's: never asks prompt logprobs


class DraftModelProposer:
    """Args: ``path`` of the draft model; the target's ``vocab_size`` (the draft's must be
    equal); ``max_model_len``; ``max_seqs``: sequences that draft at once. The draft's cache
    holds as many tokens as the target's (``max_blocks`` blocks of ``block_size``), at most
    ``max_seqs`` sequences of max_model_len + ``k``; a sequence whose mirror finds no free
    block drafts nothing that step. Raises ValueError for a draft whose vocabulary differs or
    whose layers use sliding windows."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype, vocab_size: int,
                 max_model_len: int, max_seqs: int, k: int, block_size: int,
                 max_blocks: int):
        from pagedserve.worker import load_model

        source = open_model(path)
        cfg = source.config
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary has "
                             f"{cfg.vocab_size} tokens, the target's {vocab_size}; they must "
                             "share the tokenizer")
        if any(w is not None for w in cfg.layer_windows()):
            raise ValueError("speculative_config.model: a draft model with sliding-window "
                             "layers is not supported")
        self.net, weight_bytes = load_model(source, dtype, device, None, TPGroup(0, 1))
        self.max_len = min(max_model_len + k, cfg.max_position_embeddings)
        self.net.init_rotary(self.max_len)
        # as many tokens as the target's cache holds, at most max_seqs full-length sequences
        num_blocks = min(max_seqs * cdiv(self.max_len, block_size), max_blocks)
        spec = resolve_kv_cache_dtype("auto", dtype)
        cache = KVCache.allocate(cfg, num_blocks, block_size, spec, device, 0,
                                 kv_layout([None] * cfg.num_hidden_layers))
        self.runner = ModelRunner(self.net, cache, device, watch_contention=False)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.mirrors: dict[int, tuple[Sequence, Sequence]] = {}  # seq_id -> (seq, mirror)
        logger.info("draft model %s: %.1f MB of weights, KV cache of %d blocks (%.2f GiB)",
                    source.path.name, weight_bytes / 1e6, num_blocks, cache.nbytes / 2**30)

    def _mirror(self, seq: Sequence) -> Sequence:
        """``seq``'s mirror, holding in its cache the longest prefix of ``seq``'s tokens."""
        entry = self.mirrors.get(seq.seq_id)
        if entry is None:
            mirror = Sequence(seq.seq_id, seq.request, MIRROR_INDEX, [])
            self.mirrors[seq.seq_id] = (seq, mirror)
        else:
            mirror = entry[1]
        same = 0
        for a, b in zip(mirror.token_ids, seq.token_ids):
            if a != b:
                break
            same += 1
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, same)
        mirror.token_ids = list(seq.token_ids)
        self.blocks.trim(mirror)
        return mirror

    def _drop(self, seq_id: int) -> None:
        _, mirror = self.mirrors.pop(seq_id)
        self.blocks.free(mirror)

    @torch.inference_mode()
    def propose_batch(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k greedy drafts for each (sequence, k)."""
        asked = {seq.seq_id for seq, _ in wanted}
        for seq_id, (seq, _) in list(self.mirrors.items()):  # finished, or not drafting now
            if seq.is_finished or seq_id not in asked:
                self._drop(seq_id)
        live: list[tuple[Sequence, int]] = []  # (mirror, drafts it still makes)
        for seq, k in wanted:
            k = min(k, self.max_len - seq.num_tokens)
            if k > 0:
                live.append((self._mirror(seq), k))
        step = 0
        while live:
            sched = SchedulerOutput()
            for mirror, _ in live:
                if mirror.num_computed_tokens == mirror.num_tokens:
                    mirror.num_computed_tokens -= 1  # the last token's logits are needed
                n = mirror.num_tokens - mirror.num_computed_tokens
                if not self.blocks.can_allocate([(mirror, n, [])]):
                    continue  # no room: this sequence drafts no further now
                self.blocks.allocate(mirror, n, [], sched.blocks_to_copy)
                sched.scheduled.append(ScheduledChunk(mirror, n))
            if not sched.scheduled:
                break
            out = self.runner.execute(sched)
            tokens = out.logits.argmax(dim=-1).tolist()
            for mirror, n in sched.scheduled:
                mirror.num_computed_tokens += n
            for mirror, token in zip(out.sample_seqs, tokens):  # the runner's row order
                mirror.append_token(token)
            step += 1
            scheduled = {id(m) for m, _ in sched.scheduled}
            live = [(m, k) for m, k in live if id(m) in scheduled and step < k]
        drafts = []
        for seq, k in wanted:
            entry = self.mirrors.get(seq.seq_id)
            drafts.append(entry[1].token_ids[seq.num_tokens:seq.num_tokens + k]
                          if entry and k > 0 else [])
        return drafts
